"""``pretrain evaluate``: the validation loss and perplexity of one checkpoint, as JSON.

A rank program (run it alone, or under torchrun for several ranks): it builds the config's model at
the config's topology, verifies and loads the given checkpoint, and evaluates ``eval.iters`` global
batches of the valid split (``data.split`` must give it a weight). The checkpoint is

* a step directory of the reshardable tier (``.../steps/step-N`` with ``model/``): loadable at any
  TP/PP/DP;
* a tier-1 step directory of one rank (``.../ranks/rank-00000/steps/step-N`` or a replica's): every
  rank loads its own sibling, so the topology must be the one it was saved at;
* ``s3://bucket/prefix`` or ``file:///path`` (the run's tier 3, ``--step`` or the newest committed
  step): downloaded, every byte verified, then loaded as a reshardable step.

A reshardable or S3 step is loaded only if its manifest's ``SIGNATURE`` verifies under the training
run's key (``PRETRAIN_RUN_KEY_FILE``, ``checkpoint.integrity.run_key_file``, or the config's own run
directory's ``run.key``): a step written by anyone without the key is refused before a byte of it is
unpickled. Evaluate never creates a key; a missing one stops it in one line naming the file and the fix.

This is how a team picks a checkpoint: the same weights give the same loss at any topology.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from pretrain.checkpointing.reshardable import ReshardableCheckpoints, wait_for_writer_warmup
from pretrain.checkpointing.run_key_source import key_path
from pretrain.config import Config, validate
from pretrain.errors import ConfigError
from pretrain.evaluation import Evaluator
from pretrain.platform import cpu_shims
from pretrain.platform.rank_device import select_rank_device
from pretrain.session import Session, build_session
from tiering.collective import TorchCollective
from tiering.digest import PORTABLE_HASH
from tiering.errors import RunKeyError, VerificationError
from tiering.layout import RunLayout
from tiering.peer.restore import PeerRestore
from tiering.remote.tier import RemoteTier
from tiering.trust.run_key import load as load_key
from tiering.trust.signature import SIGNATURE_NAME, ManifestSigner
from tiering.verify import verify_step


def run_signer(cfg: Config) -> ManifestSigner:
    """The signer of the training run's key, read (never created) from where the run keeps it."""
    path, _ = key_path(cfg.checkpoint.integrity, cfg.run)
    try:
        return ManifestSigner(load_key(path))
    except RunKeyError as exc:
        raise ConfigError(
            f"{exc}; evaluate loads only steps signed with the training run's key: name it with "
            "--set checkpoint.integrity.run_key_file=PATH (or PRETRAIN_RUN_KEY_FILE)"
        ) from exc


def _load_remote(session: Session, uri: str, step: int | None, coll: TorchCollective, signer: ManifestSigner) -> Path:
    """Rank 0 downloads and verifies the step into a local directory every rank can read."""
    where = None
    if coll.rank == 0:
        s3 = session.cfg.checkpoint.s3
        remote = RemoteTier.open(
            uri, session.cfg.run.id, endpoint_url=s3.endpoint_url, concurrency=s3.concurrency,
            connect_timeout_s=s3.connect_timeout_s, read_timeout_s=s3.read_timeout_s,
            signer=signer, expect_hash=PORTABLE_HASH,
        )  # fmt: skip
        chosen = step if step is not None else next(iter(remote.committed_steps()), None)
        if chosen is None:
            raise ConfigError(f"{uri}: run {session.cfg.run.id} has no committed step; fix: check the URI and run.id")
        layout = RunLayout(Path(tempfile.mkdtemp(prefix="rp-evaluate-")), session.cfg.run.id)
        where = str(remote.download_step(chosen, layout, "evaluate"))
    return Path(coll.broadcast(where))


def _load_tier1(session: Session, path: Path) -> None:
    """Each rank loads its own copy of the step (sibling ``rank-NNNNN`` directory), verified."""
    mine = path.parents[2] / f"rank-{session.rank:05d}" / "steps" / path.name
    verify_step(mine, expect_run_id=session.cfg.run.id)
    if session.tiers.local is None:
        raise ConfigError(f"{path}: a tier-1 step needs checkpoint.local.enabled; fix: enable it for evaluate")
    step = int(path.name.split("-")[-1])
    session.tiers.local.load(PeerRestore(step, mine, "local", str(mine), 0.0), session.state)


def load_checkpoint(session: Session, checkpoint: str, step: int | None) -> str:
    """Collective: verify and load ``checkpoint`` into the session; returns the kind loaded."""
    coll = TorchCollective()
    signer = run_signer(session.cfg)
    if checkpoint.startswith(("s3://", "file://")):
        path, kind = _load_remote(session, checkpoint, step, coll, signer), "s3"
    else:
        path = Path(checkpoint)
        kind = "reshardable" if (path / "model").is_dir() else "local"
    if not path.is_dir():
        raise ConfigError(f"{path}: no such step directory; fix: pass a step-NNNNNNNNN directory or an s3:// URI")
    if kind == "local":
        _load_tier1(session, path)
    else:
        reshardable = ReshardableCheckpoints(
            session.cfg, coll, "evaluate", directory=str(path.parents[2]), signer=signer
        )
        reshardable.load_step_dir(path, session.state)
    return kind


def evaluate(cfg: Config, checkpoint: str, step: int | None = None) -> dict[str, Any]:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    validate(cfg, world, cuda)
    if cfg.data.split_weights()[1] == 0:
        raise ConfigError(f"{cfg.source}: data.split={cfg.data.split} has no valid split; fix: e.g. 98,2,0")
    cpu_shims.install()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    select_rank_device()  # NCCL binds to the current device: this rank's GPU, not cuda:0
    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10)
    )
    try:
        session = build_session(cfg, rank, world, "evaluate")
        kind = load_checkpoint(session, checkpoint, step)
        dp = (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
        loss = Evaluator(cfg, session.valid, session.ddp, *dp).loss()
        return {
            "checkpoint": checkpoint,
            "kind": kind,
            "step": session.state.step,
            "topology": session.state.topology,
            "eval_iters": cfg.eval.iters,
            "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        }
    finally:
        wait_for_writer_warmup()  # a Megatron writer manager still starting would hang the exit
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_evaluate(cfg: Config, checkpoint: str, step: int | None) -> int:
    try:
        result = evaluate(cfg, checkpoint, step)
    except VerificationError as exc:
        if SIGNATURE_NAME in str(exc):  # most often: the step of another run, checked with this one's key
            key, _ = key_path(cfg.checkpoint.integrity, cfg.run)
            raise ConfigError(
                f"{checkpoint}: its signature does not verify under the run key {key}: {exc}; a step of "
                "another run needs that run's key: --set checkpoint.integrity.run_key_file=PATH"
            ) from exc
        raise ConfigError(f"{checkpoint}: does not verify: {exc}") from exc
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
    return 0
