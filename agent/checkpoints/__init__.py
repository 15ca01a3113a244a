"""The node's checkpoints, agent side: shared memory, persistence to disk, replication to peers.

Promises: the keeper (``keeper``) owns the node's shared-memory folder (``shm_folder``, held by a lock for
the agent's lifetime), persists checkpoints to ``--ckpt-dir`` atomically in the background
(``persist``, ``sharded_persist``) fenced against older rounds (``fence``) and replicates sharded saves to
peer nodes (``replication``, ``replication_wire``, ``replica_server``).

Owns: the node's checkpoint memory and its copies on disk and on peers. Imports no torch.
"""
