"""The `dflash-chat` command: its flags, the app they ask for, and the console script.

dflash-chat [--model PATH_OR_REPO] [--draft PATH_OR_REPO] [--temp T] [--top-p P]
            [--top-k K] [--block-size B] [--tree-budget N] [--lookup N] [--max-tokens N] [--system TEXT]
            [--no-draft] [--kv-bits N] [--kv-group-size G] [--quantized-kv-start N] [--prompt-cache-file FILE]
"""

from __future__ import annotations

import argparse
import sys

from dflash_mlx.options import DecodeOptions, OptionError

from .app import ChatApp
from .engine import Settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-chat",
        description="Chat with a local model, several times faster with DFlash speculative decoding.",
    )
    p.add_argument("--model", default=None, help="target model path or HF repo (default: built-in)")
    p.add_argument("--draft", default=None, help="DFlash drafter path or HF repo (default: the target's)")
    d = DecodeOptions()
    p.add_argument("--temp", type=float, default=d.temp, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling threshold")
    p.add_argument("--top-k", type=int, default=d.top_k, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="drafter block size (default: adaptive)")
    p.add_argument(
        "--tree-budget",
        type=int,
        default=d.tree_budget,
        help="draft-tree nodes per cycle (0: chains only; default: chosen per cycle with an adaptive block size)",
    )
    p.add_argument(
        "--lookup", type=int, default=d.lookup, help="prompt lookup: longest context suffix matched (0: off)"
    )
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--draft-vocab", default=None, help="draft vocabulary file, or 'none' (default: the drafter's own)")
    p.add_argument("--no-draft", action="store_true", help="start in baseline mode (target only; /baseline toggles)")
    p.add_argument("--no-kernels", action="store_true", help="no custom Metal kernels (default: used on Apple GPUs)")
    p.add_argument("--kv-bits", type=int, default=d.kv_bits, help="quantize the target's KV cache (default: off)")
    p.add_argument("--kv-group-size", type=int, default=d.kv_group_size, help="KV cache quantization group size")
    p.add_argument("--quantized-kv-start", type=int, default=d.quantized_kv_start, help="tokens before quantizing")
    p.add_argument(
        "--prompt-cache-file", default=None, help="a prefix saved by dflash cache-prompt: the conversation follows it"
    )
    return p


def app_from_args(argv: list[str] | None = None) -> ChatApp:
    """The app the command line asks for; a bad option is an `OptionError` naming it."""
    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be positive, got {args.max_tokens}")
    kernels = False if args.no_kernels else None
    options = DecodeOptions(
        args.temp,
        args.top_p,
        args.top_k,
        block_size=args.block_size,
        kernels=kernels,
        tree_budget=args.tree_budget,
        lookup=args.lookup,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
    )
    settings = Settings(options, max_tokens=args.max_tokens, baseline=args.no_draft)
    return ChatApp(
        model=args.model,
        draft=args.draft,
        settings=settings,
        system=args.system,
        draft_vocab=args.draft_vocab,
        prompt_cache_file=args.prompt_cache_file,
    )


def check_prompt_cache(app: ChatApp) -> None:
    """Refuse (a ValueError of one line) a prompt cache file that is not one, or is for
    another target or drafter, before the app starts."""
    if app.prompt_cache_file is not None:
        from dflash_mlx.cache import cache_ids, read_file

        read_file(app.prompt_cache_file, *cache_ids(app.model_path, app.draft_path))


def main(argv: list[str] | None = None) -> None:
    try:
        app = app_from_args(argv)
        check_prompt_cache(app)
    except OptionError as e:  # one line naming the flag, exit code 1
        sys.exit(f"dflash-chat: error: {e.named('--' + e.field.replace('_', '-'))}")
    except ValueError as e:
        sys.exit(f"dflash-chat: error: {e}")
    app.run()


if __name__ == "__main__":
    main()
