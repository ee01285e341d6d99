"""Pipeline parallelism: a model's layers cut into stages over the "pp" ranks, microbatches run by a schedule.

- ``apply``: ``apply_pipeline`` (cut and prune to this rank's stages) and ``build_pipeline`` (the stages and
  their schedule, run by the model's own calls).
- ``schedules``: MegaScale's decoupled 1F1B (``ScheduleDecoupled1F1B``) and the timeline its bubble is
  measured on.
- ``interleaved``: the interleaved (virtual-stage) 1F1B with the same decoupled communication.

Nothing is imported here: torch.distributed.pipelining imports much of torch, which code that never builds a
pipeline should not pay for (``megascale.core.parallel`` exports the schedules lazily).
"""
