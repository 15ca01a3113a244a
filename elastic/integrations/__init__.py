"""Framework integrations: flash checkpoints from Lightning and the Hugging Face Trainer, loop unchanged.

Promises: each integration is one module whose callback saves, every N optimizer steps, everything the
framework's own resume needs (weights, optimizers, LR schedulers, the loop's progress and data position)
plus every rank's RNG states, with :func:`elastic.save` (a memory copy into the agent's shared memory,
persisted in the background), and restores the newest step any rank holds with :func:`elastic.load` so
that the loop goes on with the next batch: at a fixed world size, a run that loses a worker ends with
the weights of a run that did not, redoing at most the step in progress. What every integration's
checkpoint holds besides the framework's state (the RNG states, the name of the loop that wrote it) is
``loop_checkpoint``'s.

- ``lightning``: ``ElasticCheckpoint`` (a ``lightning.pytorch.Callback``; restores at ``on_fit_start``)
  and ``ElasticDataLoader`` (an :class:`elastic.ElasticSampler` under a DataLoader Lightning can resume).
- ``huggingface``: ``ElasticTrainerCallback`` (a ``transformers.TrainerCallback``); its
  ``resume_checkpoint(trainer)`` hands the newest flash checkpoint to the Trainer's own
  ``train(resume_from_checkpoint=...)`` as a folder in the Trainer's format, which also restores the data
  position (the Trainer's sampler, fast-forwarded).

Raises: :class:`elastic.CheckpointError` when the newest checkpoint was written by another loop (another
framework, or a plain ``elastic.save`` script) or does not match the trainer (another number of
optimizers or schedulers): one line naming the step and the way out (``--ckpt-reset``).

Owns: nothing beyond the checkpoints' content; the files are :mod:`elastic.checkpoint`'s. Importing this
package imports nothing; a module imports its framework (and torch) when it is imported, so
``import elastic`` never loads Lightning or transformers. Install them with the ``frameworks`` extra.
"""
