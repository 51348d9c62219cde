"""DFlash over a target sharded by mlx-lm across real processes: `mlx.launch --backend ring`
on loopback, as on several Macs. Tensor parallel over 3 ranks (SmolLM2: 9 heads, 3 KV
heads) prints mlx-lm's own greedy text; tiny random qwen3 / qwen3_5 targets over 2 ranks
give single-process DFlash's seeded samples and, under pipeline parallel, the same captured
features though the captured layers live on different ranks; `dflash serve` over 3 ranks
answers as one process does and stops cleanly. Run as a script under
`mlx.launch`, this file is the worker (rank 0 prints one JSON line)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Tell me a story"
VOCAB = 49152  # the default model's tokenizer


def start(ranks: int, *args: str, **streams) -> subprocess.Popen:
    """Start `args` on `ranks` local processes with mlx.launch (ring backend on loopback), in
    a process group of their own; `streams`: stdout and stderr (default: pipes)."""
    bindir = Path(sys.executable).parent
    launcher = shutil.which("mlx.launch", path=str(bindir))
    if launcher is None:
        pytest.skip("mlx.launch is not installed")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=path)
    command = [launcher, "-n", str(ranks), "--backend", "ring", sys.executable, *args]
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams}
    return subprocess.Popen(command, text=True, env=env, cwd=ROOT, start_new_session=True, **streams)


def launch(ranks: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `args` as `start` does and wait; the whole process group is killed if it
    outlives `timeout`."""
    proc = start(ranks, *args)
    command = proc.args
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        out, err = proc.communicate()
        pytest.fail(f"mlx.launch timed out after {timeout}s: {err[-1000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


CLI = ("-c", "from app.cli.main import main; main()")


def cli(ranks: int, *args: str) -> subprocess.CompletedProcess:
    return launch(ranks, *CLI, *args)


def worker(ranks: int, *args: str) -> dict:
    proc = launch(ranks, __file__, *args)
    assert "Error" not in proc.stderr, proc.stderr[-2000:]  # mlx.launch exits 0 whatever the ranks do
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # rank 0 alone prints
    return json.loads(lines[0])


def test_tensor_parallel_three_ranks_prints_mlx_lms_text(default_model_dir):
    import mlx_lm

    proc = cli(3, "generate", "--prompt", PROMPT, "--max-tokens", "4", "--check-ranks")
    assert "error" not in proc.stderr, proc.stderr[-2000:]
    model, tokenizer = mlx_lm.load(str(default_model_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    assert proc.stdout == mlx_lm.generate(model, tokenizer, prompt, max_tokens=32) + "\n"
    assert proc.stderr.count("Acceptance: tau") == 1  # the followers print nothing


def test_serve_three_ranks_answers_as_one_process(default_model_dir, tmp_path):
    """Rank 0 serves, ranks 1 and 2 follow: greedy text is mlx-lm's, a seeded sample is
    single-process DFlash's, a stream after a cancelled one is the greedy text again (the
    ranks stopped together and reuse the same caches), and Ctrl-C stops every rank cleanly."""
    import mlx_lm
    import openai

    from dflash_mlx import load_draft, stream_generate

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = start(3, *CLI, "serve", "--port", str(port), stdout=subprocess.DEVNULL, stderr=err)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": PROMPT}]
    try:
        wait_for_health(proc, port, log)

        def ask(max_tokens: int = 32, **kwargs):
            return client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, **kwargs)

        greedy = ask(temperature=0).choices[0].message.content
        sampled = ask(temperature=1.0, seed=3).choices[0].message.content
        left = ask(500, temperature=1.0, stream=True)  # a client gone after its first chunks stops every rank
        next(left), next(left)
        left.close()
        streamed = "".join(c.choices[0].delta.content or "" for c in ask(temperature=0, stream=True) if c.choices)
    finally:
        interrupt_ranks(proc)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the ranks did not stop: {log.read_text()[-2000:]}")
    text = log.read_text()
    assert "error" not in text.lower() and "WARN" not in text, text[-2000:]  # mlx.launch warns of a rank's exit code
    assert proc.returncode == 0 and text.count("Finished server process") == 1  # rank 0 alone served
    model, tokenizer = mlx_lm.load(str(default_model_dir))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert greedy == streamed == mlx_lm.generate(model, tokenizer, prompt, max_tokens=32)
    one = stream_generate(model, tokenizer, prompt, load_draft(None, model=model), temp=1.0, seed=3, max_tokens=32)
    assert sampled == "".join(r.text for r in one)


def interrupt_ranks(proc: subprocess.Popen) -> None:
    """Ctrl-C as a terminal sends it to every process of the launch, but the launcher (its
    main thread dies of it in mlx 0.32 and then relays no more output)."""
    group = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in {int(p) for p in group} - {proc.pid}:
        os.kill(pid, signal.SIGINT)


def wait_for_health(proc: subprocess.Popen, port: int, log: Path, seconds: float = 240) -> None:
    """Wait until the server on `port` says it is ready."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"the server did not come up: {log.read_text()[-2000:]}")


@pytest.mark.parametrize("family, sharding", [("qwen3", "tensor"), ("qwen3_5", "pipeline")])
def test_two_ranks_match_one_process(default_model_dir, tmp_path, family, sharding):
    from dflash_mlx.drafters import load_drafter_dir

    model_dir, draft_dir = tiny_pair(family, default_model_dir, tmp_path)
    got = worker(2, "worker", str(model_dir), str(draft_dir), sharding)
    want = run(model_dir, load_drafter_dir(draft_dir), None)
    assert got["smollm2_tensor"] == (
        "tensor parallel over 2 ranks needs head counts that divide by 2; the model has 9 attention and 3 KV heads"
    )
    assert got["greedy"] == want["greedy"]
    assert got["sampled"] == want["sampled"]
    assert mx.allclose(mx.array(got["features"]), mx.array(want["features"]), atol=1e-4).item()


def test_unreachable_rank_is_one_line(tmp_path):
    hostfile = tmp_path / "hosts.json"  # as mlx.launch writes it; nobody listens there
    hostfile.write_text('[["127.0.0.1:1"], ["127.0.0.1:2"]]')
    env = dict(os.environ, MLX_RANK="0", MLX_HOSTFILE=str(hostfile), DFLASH_CONNECT_TIMEOUT="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-c", "from app.cli.main import main; main()", "generate", "--prompt", PROMPT]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith("error: rank 0 on ") and "reached no other rank in 1s" in proc.stderr


@pytest.mark.parametrize(
    "family, sharding, keep, message",
    [
        ("llama", "pipeline", ("config.json", "model.safetensors.index.json"), "mlx-lm cannot shard 'llama' this way"),
        ("qwen3_5", "pipeline", ("config.json", "model.safetensors"), "pipeline sharding needs"),
        ("qwen3", "tensor", ("config.json",), "weights missing"),
    ],
)
def test_sharding_errors_name_the_cause(default_model_dir, tmp_path, family, sharding, keep, message):
    from dflash_mlx import load
    from dflash_mlx.errors import UserError

    path = tiny_target_dir(family, default_model_dir, tmp_path)
    for file in path.iterdir():
        if file.name not in keep and not file.name.startswith("tokenizer"):
            file.unlink()
    with pytest.raises(UserError, match=message):
        load(str(path), sharding=sharding)


def tiny_target_dir(family: str, tokenizer_dir: Path, tmp_path: Path) -> Path:
    """A tiny random `family` target saved with mlx-lm's weight index (pipeline loading reads it)."""
    from tiny_targets import save_tiny_target

    path = save_tiny_target(family, tmp_path / family, tokenizer_dir, VOCAB)
    keys = mx.load(str(path / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def tiny_pair(family: str, tokenizer_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A tiny random 4-layer `family` target and a random drafter reading its first and last layers."""
    from dflash_mlx.drafter import Drafter
    from dflash_mlx.drafters import save_drafter
    from tiny_targets import tiny_drafter_config

    path = tiny_target_dir(family, tokenizer_dir, tmp_path)
    mx.random.seed(1)
    config = tiny_drafter_config(4, 4, VOCAB)
    save_drafter(Drafter(config), tmp_path / "draft")
    return path, tmp_path / "draft"


def run(model_dir: Path, drafter, sharding) -> dict:
    """Greedy and seeded (T = 1) DFlash tokens and the captured features of the prompt."""
    from dflash_mlx import load
    from mlx_lm.models.cache import make_prompt_cache as make_target_cache
    from dflash_mlx.targets import make_target
    from references import dflash_tokens

    model, tokenizer = load(str(model_dir), sharding=sharding)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    target = make_target(model, drafter.config.target_layer_ids)
    _, features = target.forward(mx.array(prompt)[None], make_target_cache(model))  # (1, L, 2 * hidden)

    greedy, sampled = (dflash_tokens(model, prompt, drafter, 8, temp=temp, seed=3)[0] for temp in (0.0, 1.0))
    return {"greedy": greedy, "sampled": sampled, "features": features.tolist()}


def _worker(model_dir: str, draft_dir: str, sharding: str) -> None:
    """One rank of `test_two_ranks_match_one_process`; it also reports the one-line error of
    SmolLM2 (9 heads) tensor parallel over these 2 ranks."""
    from dflash_mlx import load
    from dflash_mlx.distributed import is_leader
    from dflash_mlx.drafters import load_drafter_dir
    from dflash_mlx.errors import UserError

    result = run(Path(model_dir), load_drafter_dir(draft_dir), sharding)
    try:
        load(None, sharding="tensor")
    except UserError as e:
        result["smollm2_tensor"] = str(e)
    if is_leader():
        print(json.dumps(result), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(*sys.argv[2:])
