"""Where the job's durable state lives, and who may serve the job.

Promises: one store interface (``base.StateStore``) with ``MemoryStore`` for a standalone master and
``EtcdStore`` (etcd, one leader per job by a lease, writes only what changed: ``etcd_layout``) for a master
with standbys; ``base.open_store`` opens the store a ``--store`` URL names and imports the etcd client only
then.

Raises: ``base.StoreError`` and its kinds (lost leadership, unreachable store, unreadable schema).

Owns: the etcd client: nothing outside this package imports it.
"""
