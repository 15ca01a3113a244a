"""Warm worker starts: fork workers from a zygote that has already imported torch.

Promises: a forked worker looks exactly like an exec'd one (environment, argv, ``__main__``, cwd, session);
the zygote never forks after CUDA is initialised, and the launcher (``starter``) falls back to exec starts
when a start is not one it can take. The zygote's own code (``zygote_ops``, ``_zygote_worker``,
``_zygote_proc``) is standard library only and travels as source (``starter.BUNDLE``).

Owns: the zygote process.
"""
