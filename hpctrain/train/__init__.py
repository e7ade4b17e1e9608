"""Training: one step loop over a dense engine and an embedding store.

Roles. :class:`~hpctrain.train.job.TrainingJob` makes every rank agree on the job (table
sizes, the parameter-server plan, the checkpoint to resume from) and gives it a role: a
worker runs a :class:`~hpctrain.train.trainer.Trainer`, a parameter-server rank serves its
shards. :func:`~hpctrain.train.build.build_worker` is the one place that reads the mode and
builds a worker's parts: a dense engine (:mod:`hpctrain.train.engine`) and an embedding
store (:mod:`embeddings.types`), with the step statistics they register
(:mod:`hpctrain.train.stats`).

Layers. The trainer sits on ``models``, ``data`` and ``parallel``, which sit on ``ps``,
then ``embeddings``, then ``comm`` and ``sync``, then ``runtime``.

One step, the same in every mode: read this worker's slice of the global batch; the engine
brings its dense parameters up to date (``begin``), runs forward and backward over the
micro-batches with lookups from the store, reduces gradients and statistics (``reduce``);
the non-finite verdict skips or stops the step on every worker alike; the engine applies
it (``update``) and the store takes the touched rows' gradients (``push``). Per mode:

- replicated: every worker holds every row (``ReplicatedTables``); the engine
  (``ReplicatedDense``) sums gradients and statistics in bucketed allreduces that start
  during the last backward, divides by the global count and steps the dense optimizer;
  the push all-gathers the touched rows and applies the same update everywhere. With
  ``train.zero = 1`` its optimizer (``ZeroOptimizer``) steps this worker's chunk of the
  parameters and allgathers the rest; with ``sync.dense = "local:H"`` the engine is
  ``LocalSGDDense``: statistics summed every step, gradients kept local, parameters
  averaged every H steps.
- all-to-all: as replicated, but each worker owns a shard of the rows
  (``ShardedTables``, planned on worker 0); lookups and pushes are ``alltoallv`` exchanges
  with the rows' owners, which apply the sparse optimizer; the trainer announces each
  step's next micro-batch, whose lookup then rides in the push.
- PS hybrid: as replicated, but the rows live on the servers behind ``PSClient``, which
  prefetches the next micro-batch's rows and pushes the gradients to their shards.
- PS full: the dense parameters are one more table on the servers; ``ServerDense`` pulls
  them before each step, reduces nothing (the global count is known, the verdict is the
  worker's own) and adds the dense gradient rows to the store's push.
- tiered: as PS hybrid behind ``TieredStore``: hot rows replicated on the workers (their
  gradients summed over the workers; each worker's hot-row count rides in the step
  statistics), cold rows on the servers, rows moving between tiers every
  ``tiering.interval`` steps.
- tensor/pipeline: ``GridDense`` keeps one pipeline stage, tensor-parallel within it; the
  pipeline schedule runs the micro-batches and reduces over the grid; the tables live on
  stage 0 (``ReplicatedTables`` over its data group; later stages hold ``NoTables``).

Evaluation is written once (``Trainer.evaluate``): each replica scores its share of the
eval split through the engine's ``predict``. Checkpoints hold the engine's dense state and
each store's own part (``save``/``restore``).
"""
