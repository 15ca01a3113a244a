"""The control plane shared by the master and the agents; never imported by a training worker.

Promises: the wire protocol (``protocol``: versioned ``/v1`` JSON models, pydantic), the one error table
that says what an agent does about each (status, code) a master answers (``error_table``), the job's
settings with every default in one place (``job_settings``, ``cli_options``), the master client and its
agent streams (``client``, ``stream_client``, ``stream_transport``), and the security rules of
every listener (``auth`` tokens, ``tls`` contexts, ``listener_rules``, ``addresses``).

Raises: ``error_table.MasterError`` and its kinds for every failed call to a master.

Owns: the wire format. Imports no torch: the agent and the master must stay torch-free.
"""
