"""Every exception of the rank program, in one leaf module (it imports nothing from ``pretrain``).

Each message is one line: what is wrong, where (file, key, rank), and ``fix:``. Every error raised
on purpose derives from :class:`PretrainError` (checkpoint errors also from ``tiering``'s
``CheckpointError``); the three ways out of a rank that are not failures, :class:`PreemptedError`,
:class:`JobStopped` and :class:`StragglerExcluded`, are ``SystemExit`` so that nothing catching
``Exception`` can swallow them. The failure classification (``pretrain.resilience.failures``) keys
on these classes, so there is exactly one of each: a second ``DataError`` defined elsewhere would
be classified as a user error.
"""

from __future__ import annotations

from tiering.errors import CheckpointError

STOP_EXIT_CODE = 2  # run-level: a stopped run or a config error; the JobSet's "do not restart" code
EXCLUDED_EXIT_CODE = 3  # node-local: a node left out (straggler) or unfit to launch on; run elsewhere


class PretrainError(Exception):
    """Root of every error the rank program and its commands raise on purpose."""


class ConfigError(PretrainError, ValueError):
    """A configuration problem; ``str(err)`` is one line: file, key, problem, fix."""


class DataError(PretrainError, RuntimeError):
    """Training input is missing, unreadable or corrupt (names the file and the fix)."""


class LaunchError(PretrainError, RuntimeError):
    """One line: what is wrong with the launch environment and how to fix it."""


class NonFiniteError(PretrainError, FloatingPointError):
    """Loss or gradient norm became NaN/Inf at a step."""

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(f"{what} is {value} at step {step}")
        self.step = step
        self.what = what


class PreemptedError(SystemExit):
    """Raised after an emergency save (or past its deadline) to leave the rank program cleanly."""

    EXIT_CODE = 143  # 128 + SIGTERM: schedulers read it as "terminated", not "succeeded"

    def __init__(self, message: str) -> None:
        super().__init__(self.EXIT_CODE)
        self.message = message


class JobStopped(SystemExit):
    """The job must not be retried; ``message`` says why and how to allow restarts again."""

    def __init__(self, message: str) -> None:
        super().__init__(STOP_EXIT_CODE)
        self.message = message


class StragglerExcluded(SystemExit):
    """Every rank leaves the attempt because ``node`` was written to the run's excluded-nodes file
    (a persistent straggler): the job restarts without it. Not a failure of the code."""

    def __init__(self, node: str, step: int, path: str) -> None:
        super().__init__(EXCLUDED_EXIT_CODE)
        self.node, self.step = node, step
        self.message = f"straggler excluded: node {node} at step {step} (written to {path})"


class NodeLaunchError(LaunchError):
    """A launch error of this node only (its NVMe missing or not writable, its topology file
    unreadable, no ``ft_launcher`` here): ``pretrain launch`` exits :data:`EXCLUDED_EXIT_CODE`, so
    the scheduler starts the job elsewhere instead of stopping the run."""

    EXIT_CODE = EXCLUDED_EXIT_CODE


class NodeExcluded(NodeLaunchError):
    """``pretrain launch`` on a node the run's excluded-nodes file names (one line with the fix)."""


class IncompatibleCheckpoint(PretrainError, CheckpointError):
    """The newest verified checkpoint belongs to a different model; refusing to load it."""


class FreshStartRefused(PretrainError, CheckpointError):
    """Committed steps of the run exist but none can be obtained by every rank: starting from step 0
    would silently throw the run away. One line: where the copies are, why they are unusable, the fix."""


class AgentGone(PretrainError):
    """The node's checkpoint agent did not answer in time, or refused a request (one line: why).
    Training goes on with tier 0 alone; the next tier-1 save starts a new agent."""
