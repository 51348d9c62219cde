"""The `dflash` command line: generate, bench, convert, export, data, train, eval."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="DFlash speculative decoding on MLX.")


@app.callback()
def _group() -> None:
    """DFlash speculative decoding on MLX."""


class UserError(Exception):
    """An error caused by the user's input: printed as one line, exit code 1."""


def friendly_errors(fn: Callable) -> Callable:
    """Turn expected failures into one clear line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UserError, ValueError, FileNotFoundError, FileExistsError, RuntimeError, OSError) as e:
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            typer.secho(f"error: {message}", err=True, fg="red")
            raise typer.Exit(1)
        except KeyboardInterrupt:
            typer.secho("interrupted", err=True, fg="red")
            raise typer.Exit(130)

    return wrapper


@app.command()
@friendly_errors
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt (chat template applied)."),
    model: Optional[str] = typer.Option(None, "--model", help="Target model path or Hub repo (default: SmolLM2-135M-Instruct)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter path or Hub repo (default: the shipped one for the default model)."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Decode with the target alone."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m"),
    temp: float = typer.Option(0.0, "--temp"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    block_size: Optional[int] = typer.Option(None, "--block-size"),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
) -> None:
    """Generate text with DFlash speculative decoding and print the stats."""
    from . import load, load_draft, stream_generate
    from .speculative import format_stats

    target, tokenizer = load(model)
    drafter = None if no_draft else load_draft(draft, model=target)
    if not raw and tokenizer.chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    last = None
    for last in stream_generate(target, tokenizer, prompt, drafter, max_tokens=max_tokens, temp=temp,
                                top_p=top_p, top_k=top_k, seed=seed, block_size=block_size, profile=True):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    print()
    print("=" * 10)
    if last is not None:
        print(format_stats(last))


from .converters.convert import convert_command, export_command  # noqa: E402

app.command("convert")(friendly_errors(convert_command))
app.command("export")(friendly_errors(export_command))


@app.command()
@friendly_errors
def bench(
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: SmolLM2-135M-Instruct)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter (default: the shipped one; 'random': an untrained one, to measure the loop's overhead)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="A text file (one prompt a line) or JSONL with a 'prompt' field."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m"),
    block_size: Optional[int] = typer.Option(None, "--block-size"),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Also run z-lab's MLX loop if installed."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON here."),
) -> None:
    """Plain mlx-lm vs DFlash (vs z-lab's loop) on the same prompts, side by side."""
    from rich.console import Console

    from .bench import markdown_table, read_prompts, run_bench, write_json

    console = Console(stderr=True)
    with console.status("benchmarking") as status:
        report = run_bench(model, draft, read_prompts(prompts) if prompts else None, max_tokens, block_size,
                           reference, progress=lambda msg: status.update(msg))
    print(markdown_table(report))
    if json_out:
        write_json(report, json_out)


from .train_cli import data_command, eval_command, train_command  # noqa: E402

app.command("data")(friendly_errors(data_command))
app.command("train")(friendly_errors(train_command))
app.command("eval")(friendly_errors(eval_command))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
