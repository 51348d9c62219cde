"""DFlash over a target sharded across processes or Macs started by `mlx.launch`.

The target is loaded by mlx-lm's own `sharded_load`: tensor parallel through the model's
`shard` (every rank holds a slice of every layer; the residual stream is whole on every
rank after each layer's all-reduce) or pipeline parallel through `model.model.pipeline`
(rank r holds a run of layers; the last rank runs the first layers). The drafter is small
and replicated. Every rank runs the same decoding loop on the same tokens: greedy choices
come from the same all-reduced logits and sampled ones from the same seeded noise, so the
ranks accept the same drafts without exchanging any decision; only the adaptive block
size, chosen from measured times, takes rank 0's times (`leaders_seconds`). `lockstep`
checks that the ranks agree (debug mode).

Under pipeline parallel the layers the drafter reads live on different ranks: `Stage`
runs this rank's layers between mlx-lm's receive and send, then one all-sum per forward
shares the last layer's output and every captured layer's output (each rank adds its own,
zeros elsewhere): L x (1 + k) x hidden values per forward, where mlx-lm's own forward
all-gathers L x hidden x ranks.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from .errors import UserError

#: The sharding choices: mlx-lm's two, and "auto" (tensor where the model has `shard`).
SHARDINGS = ("auto", "tensor", "pipeline")


class RanksDiverged(UserError):
    """The ranks committed different tokens: their loops are no longer in lockstep."""


#: Seconds to wait for the other ranks before giving up (the ring backend retries forever).
CONNECT_TIMEOUT = float(os.environ.get("DFLASH_CONNECT_TIMEOUT", "120"))

# The watchdog: `mx.distributed.init` blocks in C++ holding the GIL, so no thread of ours
# can speak while it waits; a small process does, unless its stdin closes first.
_WATCHDOG = """
import os, select, signal, sys
pid, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], seconds)[0]:
    sys.stderr.write(message + "\\n")
    os.kill(pid, signal.SIGKILL)
"""


@functools.cache
def world() -> mx.distributed.Group:
    """The launch's group (a group of one outside `mlx.launch`). A rank that cannot reach
    its neighbours within `CONNECT_TIMEOUT` seconds is stopped with one line on stderr."""
    if "MLX_HOSTFILE" not in os.environ and "MLX_IBV_DEVICES" not in os.environ:
        return mx.distributed.init()  # nothing to connect to
    message = (
        f"error: rank {os.environ.get('MLX_RANK', '?')} on {socket.gethostname()} reached no other rank in "
        f"{CONNECT_TIMEOUT:.0f}s (is every host up, and its address in the hostfile right?)"
    )
    args = [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(CONNECT_TIMEOUT), message]
    with subprocess.Popen(args, stdin=subprocess.PIPE) as watchdog:
        try:
            return mx.distributed.init()
        except RuntimeError as e:
            raise UserError(f"{socket.gethostname()}: cannot reach the other ranks ({e})") from None
        finally:
            watchdog.stdin.close()


def world_size() -> int:
    """How many processes share the target (1 outside `mlx.launch`)."""
    return world().size()


def is_leader() -> bool:
    """Whether this process is rank 0, the one that prints and serves."""
    return world().rank() == 0


def choose_sharding(requested: Optional[str]) -> Optional[str]:
    """The sharding a command line asked for, "auto" under `mlx.launch` when it asked for
    none, or None (load the target whole) in a single process."""
    if requested is not None and requested not in SHARDINGS:
        raise ValueError(f"--sharding must be one of {', '.join(SHARDINGS)}, got {requested!r}")
    return requested or ("auto" if world_size() > 1 else None)


def sharded_load(path: Path, sharding: str = "auto") -> tuple[nn.Module, Any]:
    """Load the target at `path` (a local model directory) sharded over the launch's ranks
    by mlx-lm's `sharded_load`, checked first so that a model mlx-lm cannot shard, or weights
    missing on this host, are one line naming the host and what is wrong."""
    from mlx_lm.utils import sharded_load as mlx_sharded_load

    config = _read_config(path)
    group = world()
    sharding = _resolve(path) if sharding == "auto" else sharding
    if sharding == "tensor":
        _check_heads(config, group.size())
    if sharding == "pipeline" and not (path / "model.safetensors.index.json").is_file():
        raise UserError(f"{here()}: pipeline sharding needs {path}/model.safetensors.index.json (mlx_lm.convert)")
    tensor = group if sharding == "tensor" else None
    pipeline = group if sharding == "pipeline" else None
    try:
        model, tokenizer = mlx_sharded_load(str(path), pipeline_group=pipeline, tensor_group=tensor)
    except ValueError as e:  # mlx-lm's "The model does not support pipelining ..."
        kind = config.get("model_type")
        raise UserError(f"mlx-lm cannot shard {kind!r} this way: {e} (try another --sharding)") from None
    missing = _missing_weights(path, getattr(model, "language_model", model).model)
    failed = mx.distributed.all_sum(mx.array(int(bool(missing))), stream=mx.cpu).item()  # every rank stops
    if missing:
        raise UserError(f"{here()}: weights missing: {', '.join(missing)} not in {path}")
    if failed:
        raise UserError(f"{here()}: {failed} other rank(s) lack weights (see their error)")
    return model, tokenizer


def _missing_weights(path: Path, body: nn.Module) -> list[str]:
    """mlx-lm's sharded load is not strict (a missing file leaves random weights): the
    files this rank reads that are not here, of those the index names for a layer of this
    rank's stage (every layer under tensor parallel) or for no layer."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        files = {"model.safetensors"}
    else:
        stage = Stage.of(body)  # a pipeline keeps layers [first, len(body.layers)) here
        mine = range(stage.first if stage else 0, len(body.layers))
        files = set()
        for key, file in json.loads(index.read_text())["weight_map"].items():
            layer = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
            if layer is None or int(layer.group(1)) in mine:
                files.add(file)
    return sorted(f for f in files if not (path / f).is_file())


def _resolve(path: Path) -> str:
    """mlx-lm's own default: tensor parallel where the model has `shard`, else pipeline."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path, lazy=True, strict=False)  # the module tree; no weights read
    return "tensor" if hasattr(model, "shard") else "pipeline"


def _read_config(path: Path) -> dict:
    """The model's config.json, or a one-line error naming this host."""
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{here()}: no model at {path} (copy it to the same path on every host)") from None


def _check_heads(config: dict, ranks: int) -> None:
    """Tensor parallel splits attention heads evenly: both head counts must divide by the ranks."""
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    if heads is not None and (heads % ranks or (kv_heads % ranks and ranks % kv_heads)):
        raise UserError(
            f"tensor parallel over {ranks} ranks needs head counts that divide by {ranks}; "
            f"the model has {heads} attention and {kv_heads} KV heads"
        )


def here() -> str:
    """This process as an error names it: "rank r on host"."""
    return f"rank {world().rank()} on {socket.gethostname()}"


class Stage:
    """This rank's place in an mlx-lm pipeline: it runs layers [first, first + count)
    after receiving the residual stream from rank + 1 and before sending it to rank - 1."""

    def __init__(self, body: nn.Module):
        self.rank, self.size = body.pipeline_rank, body.pipeline_size
        self.first = body.start_idx

    @staticmethod
    def of(body: nn.Module) -> Optional["Stage"]:
        """The stage of a pipelined decoder body, None for a whole one."""
        return Stage(body) if getattr(body, "pipeline_size", 1) > 1 else None

    def receive(self, h: mx.array) -> mx.array:
        """h (1, L, hidden): the embeddings on the first layers' rank, else the residual
        stream of the rank that runs the layers before this one."""
        return mx.distributed.recv_like(h, self.rank + 1) if self.rank < self.size - 1 else h

    def share(
        self, h: mx.array, captured: dict[int, mx.array], wanted: list[int]
    ) -> tuple[mx.array, Optional[mx.array]]:
        """Send h (1, L, hidden) on to the next stage and share with every rank the last
        layer's output and the `wanted` layers' outputs, in one all-sum. Returns (the last
        layer's output (1, L, hidden), features (1, L, len(wanted) * hidden) or None)."""
        zeros = mx.zeros_like(h)
        if self.rank != 0:
            h = mx.distributed.send(h, self.rank - 1)
        parts = [h if self.rank == 0 else zeros] + [captured.get(i, zeros) for i in wanted]
        payload = mx.concatenate(parts, axis=-1)
        if self.rank != 0:
            payload = mx.depends(payload, h)  # the send runs before the all-sum
        total = mx.distributed.all_sum(payload)  # (1, L, (1 + k) * hidden)
        width = h.shape[-1]
        return total[..., :width], (total[..., width:] if wanted else None)


def gathered_rows(head: nn.Module, ids: mx.array, group: mx.distributed.Group) -> mx.array:
    """Rows `ids` (n,) of a vocabulary-sharded output layer (rank r holds rows
    [r * V / ranks, (r + 1) * V / ranks)), dequantized and all-summed: (n, hidden)."""
    local = head.weight.shape[0]
    offset = group.rank() * local
    mine = (ids >= offset) & (ids < offset + local)
    picked = mx.where(mine, ids - offset, 0)
    if hasattr(head, "scales"):
        biases = head.biases[picked] if getattr(head, "biases", None) is not None else None
        rows = mx.dequantize(
            head.weight[picked], head.scales[picked], biases, group_size=head.group_size, bits=head.bits
        )
    else:
        rows = head.weight[picked]
    return mx.distributed.all_sum(mx.where(mine[:, None], rows, 0), group=group)


def leaders_seconds(seconds: float) -> float:
    """Rank 0's measure of a cycle's time on every rank (one scalar all-sum), so that an
    adaptive block size, chosen from measured times, chooses the same on every rank."""
    if world_size() == 1:
        return seconds
    return mx.distributed.all_sum(mx.array(seconds if is_leader() else 0.0)).item()


def lockstep(responses: Iterator[Any], check: bool = False) -> Iterator[Any]:
    """Pass a rank's generation responses through; with `check`, first all-gather each
    response's committed count and token and stop with `RanksDiverged` if ranks disagree."""
    for r in responses:
        if check and world_size() > 1:
            seen = mx.distributed.all_gather(mx.array([[r.generation_tokens, r.token]]))
            rows = seen.tolist()
            if any(row != rows[0] for row in rows):
                raise RanksDiverged(f"ranks diverged at token {r.generation_tokens}: (count, token) per rank {rows}")
        yield r
