"""``pretrain launch``: one entrypoint for Slurm and Kubernetes that execs ``ft_launcher``.

It derives node rank, number of nodes, rendezvous endpoint, node-local NVMe path, failure domain
and run id from the environment, checks that the installed ``ft_launcher`` accepts every flag it
is about to pass, and ``exec``s it (``--dry-run`` prints the exact command instead). Every bad
input fails at start with one line naming what is wrong and how to fix it.

* Slurm: ``SLURM_JOB_ID``, ``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST`` (its first node
  is the rendezvous host unless ``RDZV_HOST`` says otherwise: the sbatch exports the first of
  ``scontrol show hostnames``), ``SLURMD_NODENAME``.
* Kubernetes (StatefulSet): the pod ordinal is parsed from ``HOSTNAME`` (``pretrain-3`` -> 3), since
  ``fieldRef: metadata.name`` gives a name, not an integer; ``NNODES`` (the replica count) and
  ``RDZV_HOST`` (e.g. ``pretrain-0.pretrain``, the headless Service DNS name of pod 0).
* Both: ``RDZV_STORE_TIMEOUT`` (seconds the other nodes wait for node 0's rendezvous store, default
  1800: above node 0's restore; passed as NVRx 0.7's ``store_connect_wait_seconds`` and 0.4's
  ``read_timeout``), ``LOCAL_NVME`` (node-local checkpoint root, must exist and be
  writable), ``FAILURE_DOMAIN``
  (rack/zone/switch) or ``TOPOLOGY_FILE`` (``node domain`` lines, e.g. each node's leaf switch;
  on Kubernetes written by ``pretrain node-domain`` from the node's labels; default: the node is
  its own domain), ``RUN_ID`` (default: the config's ``run.id``).
  With a topology file, a job whose nodes all share one domain is refused (replicas would share
  the failure they exist to survive) unless ``ALLOW_SAME_DOMAIN=1``.
* A node count whose world size the parallel layout or the global batch cannot divide (a
  scale-down to 5 of 6 nodes, say) is refused with the node counts that would work; so is
  ``fault_tolerance.straggler.action: restart_without`` when one node fewer would not fit.
* Exit codes: 2 (``STOP_EXIT_CODE``) for what fails alike on every node: a stopped run, a config
  or deployment error (``NNODES`` unset, a node count the layout cannot divide); 3
  (``NodeLaunchError``) for what is wrong with this node only: ``LOCAL_NVME`` missing or not
  writable, an unreadable ``TOPOLOGY_FILE``, no runnable ``ft_launcher``, an excluded node. The
  JobSet fails the run on 2 and restarts elsewhere on 3; the sbatch ends the job on 2 and requeues
  without the node on 3.
* NVRx before 0.7 unpickles the rendezvous state from node 0's store: a multi-node launch with it is
  refused in one line unless ``RDZV_PRIVATE_NETWORK=1`` says the job's network is private
  (:func:`refuse_pickling_rendezvous`; the floor stays 0.4.1 in pyproject.toml: no 0.7 is installable
  on the CPU test machines).
* A node the run's excluded-nodes file names (a persistent straggler,
  :mod:`pretrain.resilience.excluded_nodes`) is refused in one line (exit code 3, not the stop
  code: the job is to run elsewhere); on Kubernetes the node is tainted and the pod deleted first
  (:mod:`pretrain.commands.node_taint`) so that it is scheduled on another node.
  ``--excluded-nodes`` prints the run's list for the sbatch requeue's ``--exclude``.

``ft_launcher --help`` (the truth about its flags) is cached per launcher file and NVRx version
under ``$XDG_CACHE_HOME/resilient-pretrain`` (default ``~/.cache``): it imports torch, seconds that
every launch and every pod restart would pay again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from pretrain.commands.ft_command import MONITOR_INTERVAL_S
from pretrain.commands.node_domain import ApiServer
from pretrain.commands.node_taint import keep_off
from pretrain.config import check_room_to_exclude, check_world_size, load_config
from pretrain.errors import ConfigError, LaunchError, NodeExcluded, NodeLaunchError
from pretrain.observability.runlog import run_dir
from pretrain.resilience.attempts import diagnose, needs_diagnosis, read_attempts
from pretrain.resilience.excluded_nodes import read_excluded, refusal
from pretrain.resilience.job_policy import refuse_if_stopped
from pretrain.resilience.standby.beside import start_server


@dataclass
class LaunchPlan:
    platform: str
    node_rank: int
    nnodes: int
    rdzv_endpoint: str
    node_name: str
    failure_domain: str
    local_nvme: str
    run_id: str | None
    restart_count: int
    store_timeout_s: int = 1800


def _split_top_level(text: str) -> list[str]:
    """``a[1-2],b[3,5]x`` -> ``["a[1-2]", "b[3,5]x"]``: commas outside brackets separate hosts."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError("nested or unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("unclosed bracket")
    return [*parts, text[start:]]


def _expand_ranges(ranges: str) -> list[str]:
    """``001-003,010`` -> ``["001", "002", "003", "010"]`` (zero padding kept)."""
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"bad range {part!r}")
        out += [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def _expand_host(expr: str) -> list[str]:
    """One host expression with any number of bracket groups: ``rack[1-2]-node[01-02]`` -> 4 hosts."""
    names = [""]
    for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", expr):
        names = [n + literal for n in names]
        if ranges:
            names = [n + r for n in names for r in _expand_ranges(ranges)]
    if not expr or any(not n for n in names):
        raise ValueError("empty host name")
    return names


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """A Slurm hostlist as ``scontrol show hostnames`` expands it: ``gpu[003-005,007],cpu01`` ->
    ``[gpu003, gpu004, gpu005, gpu007, cpu01]``, several bracket groups and suffixes included
    (``rack[1-2]-node[01-02]``, ``a[1-3]b``); anything it cannot read whole is a LaunchError."""
    try:
        hosts = [h for expr in _split_top_level(nodelist.strip()) for h in _expand_host(expr)]
    except ValueError as exc:
        raise LaunchError(
            f"SLURM_JOB_NODELIST={nodelist!r}: {exc}; fix: run under sbatch/srun, or export "
            'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) as slurm/pretrain.sbatch does'
        ) from exc
    return hosts


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: the rendezvous host."""
    return expand_slurm_nodelist(nodelist)[0]


def read_topology(path: str) -> dict[str, str]:
    """``node domain`` per line (``#`` comments): the failure domain (switch, rack, zone) of each node."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise NodeLaunchError(
            f"TOPOLOGY_FILE={path}: cannot read it ({exc.strerror}); fix: point it at a readable file"
        ) from exc
    out = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise LaunchError(f"{path}:{number}: expected 'node domain', got {line.strip()!r}; fix: one pair a line")
        out[words[0]] = words[1]
    return out


def failure_domain_for(env: Mapping[str, str], node: str, job_nodes: list[str]) -> str:
    if env.get("FAILURE_DOMAIN"):
        return env["FAILURE_DOMAIN"]
    path = env.get("TOPOLOGY_FILE")
    if not path:
        return node
    topology = read_topology(path)
    missing = [n for n in [node, *job_nodes] if n not in topology]
    if missing:
        raise LaunchError(f"{path}: node {missing[0]} has no failure domain; fix: add a line '{missing[0]} <domain>'")
    domains = {topology[n] for n in job_nodes}
    if len(job_nodes) > 1 and len(domains) == 1 and env.get("ALLOW_SAME_DOMAIN") != "1":
        raise LaunchError(
            f"{path} puts all {len(job_nodes)} nodes of this job in domain {domains.pop()!r}, so every replica "
            "would share the failure it exists to survive; fix: spread the job across domains (sbatch "
            "--switches / a different node set) or set ALLOW_SAME_DOMAIN=1 for a test"
        )
    return topology[node]


def _int(env: Mapping[str, str], name: str, fix: str) -> int:
    value = env.get(name)
    if value is None or value == "":
        raise LaunchError(f"{name} is not set; fix: {fix}")
    try:
        return int(value)
    except ValueError as exc:
        raise LaunchError(f"{name}={value!r} is not an integer; fix: {fix}") from exc


def _store_timeout(env: Mapping[str, str], default: int = 1800) -> int:
    """``RDZV_STORE_TIMEOUT``: seconds the other nodes wait for node 0's rendezvous store."""
    if not env.get("RDZV_STORE_TIMEOUT"):
        return default
    value = _int(env, "RDZV_STORE_TIMEOUT", "set it above node 0's restore time, in seconds")
    if value < 1:
        raise LaunchError(f"RDZV_STORE_TIMEOUT={value}; fix: set it above node 0's restore time, in seconds")
    return value


def plan_from_env(env: Mapping[str, str], port: int = 29500) -> LaunchPlan:
    if env.get("SLURM_JOB_ID"):
        platform = "slurm"
        nnodes = _int(env, "SLURM_NNODES", "run under sbatch with --nodes")
        node_rank = _int(env, "SLURM_NODEID", "start one launcher per node with srun --ntasks-per-node=1")
        job_nodes = expand_slurm_nodelist(env.get("SLURM_JOB_NODELIST", "") or env.get("SLURM_NODELIST", ""))
        # The sbatch exports RDZV_HOST from `scontrol show hostnames` (Slurm's own expansion, and
        # a site may set it to the node's address where NodeName does not resolve).
        host = env.get("RDZV_HOST") or job_nodes[0]
        node = env.get("SLURMD_NODENAME") or env.get("HOSTNAME", "")
        restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    else:
        platform = "kubernetes"
        pod = env.get("HOSTNAME") or env.get("POD_NAME")
        if not pod:
            raise LaunchError("HOSTNAME (the pod name) is not set; fix: run in a StatefulSet pod or set POD_NAME")
        m = re.fullmatch(r"(.+)-(\d+)", pod)
        if env.get("NODE_RANK"):
            # JobSet: pods are NAME-<job index>-<pod index>; the job index comes from the
            # jobset.sigs.k8s.io/job-index annotation through the downward API.
            node_rank = _int(env, "NODE_RANK", "map NODE_RANK from the jobset.sigs.k8s.io/job-index annotation")
        elif m:
            node_rank = int(m.group(2))
        else:
            raise LaunchError(
                f"pod name {pod!r} has no StatefulSet ordinal (expected NAME-N); fix: run the trainer "
                "as a StatefulSet so pods are named NAME-0, NAME-1, ... (or set NODE_RANK, as the JobSet does)"
            )
        nnodes = _int(env, "NNODES", "set NNODES to the StatefulSet's replica count")
        if not env.get("RDZV_HOST") and not m:
            raise LaunchError("RDZV_HOST is not set; fix: set it to the DNS name of the rank-0 pod")
        host = env.get("RDZV_HOST") or f"{m.group(1)}-0"  # type: ignore[union-attr]
        node = env.get("NODE_NAME") or pod
        job_nodes = [node]  # other pods' nodes are unknown here: the trainer's placement check covers them
        restarts = int(env.get("RESTART_COUNT", "0") or 0)
    if nnodes < 1:
        raise LaunchError(f"number of nodes is {nnodes}; fix: request at least one node")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(
            f"node rank {node_rank} is not below the number of nodes {nnodes}; fix: check the "
            "replica count / --nodes against the pod ordinal / SLURM_NODEID"
        )
    nvme = env.get("LOCAL_NVME")
    if not nvme:
        raise LaunchError("LOCAL_NVME is not set; fix: point it at the node-local NVMe mount for tier-1 checkpoints")
    path = Path(nvme)
    if not path.is_dir():  # this node's disk (not assembled, not created by its user data): run elsewhere
        raise NodeLaunchError(
            f"LOCAL_NVME={nvme} does not exist; fix: mount the node-local NVMe there (hostPath/local PV "
            "or emptyDir on Kubernetes, the node's scratch on Slurm)"
        )
    if not os.access(path, os.W_OK):
        raise NodeLaunchError(f"LOCAL_NVME={nvme} is not writable by uid {os.getuid()}; fix: chown it or set fsGroup")
    rdzv_port = int(env.get("RDZV_PORT", port))
    return LaunchPlan(
        platform,
        node_rank,
        nnodes,
        f"{host}:{rdzv_port}",
        node,
        failure_domain_for(env, node, job_nodes),
        nvme,
        env.get("RUN_ID"),
        restarts,
        _store_timeout(env),
    )


def rendezvous_conf(plan: LaunchPlan) -> str:
    """The c10d rendezvous settings ``--rdzv-conf`` passes (both NVRx versions hand every key to
    ``RendezvousParameters(**rdzv_configs)``, which keeps unknown keys in ``config``):

    * ``is_host``: node 0 serves the TCP store, said outright. Left to itself the launcher guesses by
      comparing the endpoint's name with its own, and if a guessed host cannot bind it quietly
      becomes a client of a store nobody serves.
    * ``store_connect_wait_seconds`` (NVRx >= 0.6, what the image runs): how long the other nodes
      probe node 0's store before giving up; unset, 0.7's launcher makes it 120 s
      (``fault_tolerance/launcher.py`` ~1366) and its patched store creation raises after it
      (``c10d_monkey_patch.py`` ~156), whatever ``read_timeout`` says. 0.4.1 ignores the key.
    * ``read_timeout``: the same wait on NVRx 0.4.1 (its default 600 s), the TCPStore's timeout.
      Node 0's launcher starts only after its restore (a Kubernetes init container downloading the
      newest step from S3, a container pull), so both must exceed it: ``RDZV_STORE_TIMEOUT``.
    * ``join_timeout``: the whole rendezvous round, at least as long (NVRx default 900 s).
    """
    is_host = 1 if plan.node_rank == 0 else 0
    wait = plan.store_timeout_s
    join = max(wait, 900)
    return f"is_host={is_host},store_connect_wait_seconds={wait},read_timeout={wait},join_timeout={join}"


def ft_launcher_argv(
    plan: LaunchPlan,
    config: str,
    nproc: int,
    max_restarts: int,
    ft_config: str,
    launcher: str,
    extra_sets: list[str],
    workers_stop_timeout: int = 15,
) -> list[str]:
    # Every flag below exists in NVRx 0.4.1 (checked by running it) and 0.7.0 (read in its
    # launcher and cli_args sources; scripts/gpu-check.sh runs check_flags against it): 0.7
    # accepts only --rdzv-backend=c10d, which it serves with its barrier rendezvous
    # (--ft-rdzv-impl=barrier, the default and only choice), so nothing changes here.
    run_id = plan.run_id or "job"
    cmd = [
        launcher,
        f"--nnodes={plan.nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={plan.rdzv_endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={rendezvous_conf(plan)}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        f"--workers-stop-timeout={workers_stop_timeout}",
        "--ft-enable-nic-monitor=false",
        f"--ft-cfg-path={ft_config}",
        "-m",
        "pretrain",
        "train",
        "--config",
        config,
        "--set",
        f"checkpoint.local.dir={plan.local_nvme}",
        "--set",
        f"checkpoint.replication.node={plan.node_name}",
    ]
    if plan.run_id:
        cmd += ["--set", f"run.id={plan.run_id}"]
    for item in extra_sets:
        cmd += ["--set", item]
    return cmd


def _help_cache(launcher: str) -> Path | None:
    """Where ``ft_launcher --help`` of this launcher file and NVRx version is kept: running it
    imports torch (5 s and more on a busy node, at every launch and restart of a pod)."""
    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
        st = os.stat(launcher)
    except (importlib.metadata.PackageNotFoundError, OSError):
        return None
    key = hashlib.sha256(f"{launcher}|{st.st_size}|{st.st_mtime_ns}|{version}".encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "resilient-pretrain"
    return base / f"ft_launcher-help-{key}.txt"


def launcher_help(launcher: str) -> str:
    """``launcher --help``, from the cache when this launcher and NVRx version were seen before."""
    cache = _help_cache(launcher)
    if cache is not None and cache.is_file():
        return cache.read_text(encoding="utf-8")
    try:
        text = subprocess.run([launcher, "--help"], capture_output=True, text=True, timeout=120).stdout
    except OSError as exc:
        raise NodeLaunchError(f"{launcher}: cannot run ({exc.strerror}); fix: install nvidia-resiliency-ext") from exc
    if cache is not None and "--nnodes" in text:
        with contextlib.suppress(OSError):  # a read-only home only costs the next launch the 5 s
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, cache)
    return text


def check_flags(launcher: str, argv: list[str]) -> None:
    """Fail fast if the installed ft_launcher does not know a flag we pass (its --help is the truth)."""
    help_text = launcher_help(launcher)
    for arg in argv[1:]:
        if arg == "-m":
            break
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and not re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", help_text, re.M):
            raise LaunchError(
                f"ft_launcher does not accept {flag} (installed: {launcher}); fix: upgrade "
                "nvidia-resiliency-ext or drop the flag from pretrain/commands/launch.py"
            )


PRIVATE_NETWORK_ENV = "RDZV_PRIVATE_NETWORK"
SAFE_RENDEZVOUS_NVRX = Version("0.7")  # its barrier rendezvous keeps the store's state as JSON


def refuse_pickling_rendezvous(plan: LaunchPlan, env: Mapping[str, str], version: str | None = None) -> str | None:
    """NVRx before 0.7 serves ``--rdzv-backend=c10d`` with ``fault_tolerance/_ft_rendezvous.py``,
    which ``pickle.loads`` the state it reads from node 0's TCP store: anyone who can reach that
    port runs code in every launcher. On a multi-node job such an NVRx is refused (LaunchError, the
    same on every node) unless ``RDZV_PRIVATE_NETWORK=1`` says only the job's nodes can reach it
    (a Kubernetes NetworkPolicy, a Slurm job network or firewall rule: docs/clusters.md). One node
    (the store on its own host) and NVRx >= 0.7 pass. Returns the refusal for a dry run to print."""
    if plan.nnodes <= 1 or env.get(PRIVATE_NETWORK_ENV) == "1":
        return None
    try:
        installed = version or importlib.metadata.version("nvidia-resiliency-ext")
        if Version(installed) >= SAFE_RENDEZVOUS_NVRX:
            return None
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        installed = version or "(not installed)"
    return (
        f"nvidia-resiliency-ext {installed} unpickles the rendezvous state it reads from node 0's store "
        f"({plan.rdzv_endpoint}), so anyone who can reach that port runs code in every launcher of this "
        f"{plan.nnodes}-node job; fix: install nvidia-resiliency-ext>=0.7 (the image's), or keep the job on a "
        f"network only its nodes reach (NetworkPolicy; Slurm: docs/clusters.md#job-network) and set "
        f"{PRIVATE_NETWORK_ENV}=1"
    )


def refuse_if_excluded(plan: LaunchPlan, rdir: Path, env: Mapping[str, str], act: bool, api: ApiServer | None) -> None:
    """NodeExcluded when the run's excluded-nodes file names this node; on Kubernetes (``act``:
    not a dry run) the node is tainted and this pod deleted first, so it is placed elsewhere."""
    line = refusal(rdir, plan.node_name)
    if line is None:
        return
    if plan.platform == "kubernetes" and act:
        line += f"; {keep_off(env, plan.node_name, rdir.name, api)}"
    raise NodeExcluded(line)


def excluded_nodes(config: str, extra_sets: list[str], env: Mapping[str, str] | None = None) -> str:
    """The run's excluded nodes, comma separated (the sbatch requeue's ``--exclude``)."""
    env = os.environ if env is None else env
    cfg = load_config(config, extra_sets)
    return ",".join(read_excluded(run_dir(cfg.run.dir, env.get("RUN_ID") or cfg.run.id)))


def blamed_node(rdir: Path) -> tuple[str, str] | None:
    """(node, evidence) the run's newest attempt record blames, or None: the host of its failed
    rank when the failure is that rank's own (infrastructure: a crash, a kill, a hardware error),
    not a peer lost to another node's failure nor a user, data or numerical error (those follow
    the run to any node). An attempt that died with its record open is diagnosed from its phase and
    failure records, read only. The sbatch requeue excludes this node, never merely the first
    node whose task exited (usually a victim of ``--kill-on-bad-exit``)."""
    records = read_attempts(rdir)
    if not records:
        return None
    record = records[-1]
    failure = diagnose(rdir, record) if needs_diagnosis(record) else record.get("failure")
    if not failure or failure.get("classification") != "infrastructure" or failure.get("peer_lost"):
        return None
    rank = failure.get("rank")
    culprits = set(failure.get("ranks") or [rank])  # ranks silent at once: blame only if on one node
    hosts = [h for h, ranks in (record.get("ranks_by_host") or {}).items() if culprits & set(ranks)]
    if rank is None or len(hosts) != 1:
        return None
    evidence = failure.get("evidence") or failure.get("exception") or f"exit code {failure.get('exit_code')}"
    return hosts[0], f"attempt {record.get('attempt')}: rank {rank} on {hosts[0]}: {evidence}"


def requeue_evidence(config: str, extra_sets: list[str], env: Mapping[str, str] | None = None) -> str:
    """One line for the sbatch requeue: ``<blamed node or -> <progressed 0|1> <evidence>``;
    progressed: the newest attempt trained past the step it restored (a healthy attempt, after
    which the requeue's earlier exclusions are dropped)."""
    env = os.environ if env is None else env
    cfg = load_config(config, extra_sets)
    rdir = run_dir(cfg.run.dir, env.get("RUN_ID") or cfg.run.id)
    records = read_attempts(rdir)
    last = records[-1] if records else {}
    restored = (last.get("restored") or {}).get("step", 0) or 0
    progressed = int((last.get("last_step") or 0) > restored)
    blame = blamed_node(rdir)
    node, evidence = blame if blame else ("-", "no attempt record blames a node")
    return f"{node} {progressed} {' '.join(evidence.split())}"


NODE_STATE_DIR = "/dev/shm/resilient-pretrain/.jobs"  # slurm/epilog.sh reads it (NODE_STATE_DIR)


def mark_node_state(job_id: str, run_id: str, dirs: list[str], env: Mapping[str, str]) -> Path:
    """Slurm: note on this node which run-local directories this job uses (tier 0 in /dev/shm,
    tier 1 on the NVMe), so that slurm/epilog.sh can remove them once the job is finished or
    cancelled, and never while it is requeued or another job of the run uses this node."""
    root = Path(env.get("NODE_STATE_DIR") or NODE_STATE_DIR)
    try:
        root.mkdir(parents=True, exist_ok=True)
        marker = root / f"{job_id}.json"
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"job": job_id, "run_id": run_id, "dirs": dirs}) + "\n", encoding="utf-8")
        os.replace(tmp, marker)
    except OSError as exc:
        raise NodeLaunchError(f"NODE_STATE_DIR={root}: cannot write ({exc.strerror}); fix: make it writable") from exc
    return marker


def launch(
    config: str,
    nproc: int,
    max_restarts: int,
    ft_config: str,
    dry_run: bool,
    extra_sets: list[str],
    env: Mapping[str, str] | None = None,
    launcher: str | None = None,
    api: ApiServer | None = None,
) -> int:
    env = os.environ if env is None else env
    plan = plan_from_env(env)
    # The config is checked here so a typo fails before any node starts; its emergency-save
    # deadline sizes how long ft_launcher lets workers finish after SIGTERM.
    cfg = load_config(config, extra_sets)
    rdir = run_dir(cfg.run.dir, plan.run_id or cfg.run.id)
    # A run stopped for a failure that would repeat must not be restarted by a requeue or a pod restart.
    refuse_if_stopped(rdir)
    refuse_if_excluded(plan, rdir, env, not dry_run, api)
    try:  # a world size the layout cannot divide (e.g. a scale-down) fails here, not in every rank
        check_world_size(cfg, plan.nnodes, nproc)
        check_room_to_exclude(cfg, plan.nnodes, nproc)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from exc
    stop_timeout = int(cfg.fault_tolerance.emergency_save_timeout) + 10
    launcher = launcher or shutil.which("ft_launcher") or str(Path(sys.executable).with_name("ft_launcher"))
    argv = ft_launcher_argv(plan, config, nproc, max_restarts, ft_config, launcher, extra_sets, stop_timeout)
    check_flags(launcher, argv)
    unsafe = refuse_pickling_rendezvous(plan, env)
    if unsafe and not dry_run:
        raise LaunchError(unsafe)
    child_env = {**env, "NODE_NAME": plan.node_name, "FAILURE_DOMAIN": plan.failure_domain}
    if dry_run:
        if unsafe:
            print(f"# a launch would be refused: {unsafe}")
        print(
            f"# {plan.platform}: node {plan.node_rank}/{plan.nnodes}, rendezvous {plan.rdzv_endpoint}, "
            f"node {plan.node_name}, domain {plan.failure_domain}, restarts so far {plan.restart_count}"
        )
        print(shlex.join(argv))
        return 0
    if plan.platform == "slurm":
        run_id = plan.run_id or cfg.run.id
        dirs = [str(Path(plan.local_nvme) / run_id)]
        if cfg.checkpoint.memory.enabled:
            dirs.append(str(Path(cfg.checkpoint.memory.dir) / run_id))
        mark_node_state(env["SLURM_JOB_ID"], run_id, dirs, env)
    if cfg.fault_tolerance.standby:  # it ends with the launcher this process becomes
        start_server(child_env)
    os.execvpe(argv[0], argv, child_env)
    return 0  # not reached
