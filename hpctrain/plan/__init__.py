"""``hpctrain plan``: predict per-rank memory and step time of the layouts a job can run on
a cluster, rank them, check them against short measured runs, and the hand formulas of
distributed training (``plan calc``). The model is pure functions (:mod:`.formulas`,
:mod:`.model`); :mod:`.cli` and :mod:`.validate` are thin layers over it."""
