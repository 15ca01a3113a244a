"""The agent's decisions as a pure state machine: events in, actions out, time passed in.

Promises: ``decisions`` maps (state, event) to a new state and a list of actions (``events`` defines both
vocabularies); it does no I/O, starts no thread and reads no clock, so every (state, event) pair is a
unit test.

Owns: the agent's lifecycle states and what each event does in each, in-process recovery included: whether
the live workers pause or stop when the node leaves a round, and when that falls back to process restarts.
"""
