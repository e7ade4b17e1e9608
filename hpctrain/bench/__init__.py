"""Every benchmark runner (``hpctrain bench ...``) in one place: ``allreduce`` and
``calibrate`` (the collectives and the cost model's parameters), ``pipeline`` (bubble and
held activations of the schedules), ``ps`` and ``tiering``. Each prints ratios against a
baseline measured in the same run; all write their tables, JSON and plots through
:mod:`hpctrain.bench.report`."""
