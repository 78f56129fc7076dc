"""Resilience: failure classification, when to stop, attempt records, phase records, preemption,
NVRx rank monitoring and in-process restart, the collective abort, and every deliberate fault."""
