"""The `dflash-chat` command: its flags, the app they ask for, and the console script.

dflash-chat [--model PATH_OR_REPO] [--draft PATH_OR_REPO] [--draft-vocab FILE|none] [--temp T] [--top-p P]
            [--top-k K] [--block-size B] [--tree-budget N] [--lookup N] [--no-kernels] [--max-tokens N]
            [--system TEXT] [--no-draft] [--kv-bits N] [--kv-group-size G] [--quantized-kv-start N]
            [--prompt-cache-file FILE] [--version]
"""

from __future__ import annotations

import argparse
import sys

from app.flags import DRAFTING, KV_CACHE, add_arguments, flag_error, from_args
from app.version import version_line
from dflash_mlx import OptionError

from .app import ChatApp
from .engine import Settings


#: The decoding options the chat's command line sets (`app.flags` makes their flags); no
#: --seed: each reply draws a fresh one.
FIELDS = ("temp", "top_p", "top_k", *DRAFTING, *KV_CACHE)


def build_parser() -> argparse.ArgumentParser:
    """The `dflash-chat` flags: the model pair, the chat's own, and the decoding options (`FIELDS`)."""
    p = argparse.ArgumentParser(
        prog="dflash-chat",
        description="Chat with a local model through DFlash speculative decoding: the target's own text, faster.",
    )
    p.add_argument("--version", action="version", version=version_line())
    p.add_argument("--model", default=None, help="Target model path or HF repo (default: built-in).")
    p.add_argument("--draft", default=None, help="DFlash drafter path or HF repo (default: the shipped one).")
    p.add_argument("--max-tokens", type=int, default=512, help="Most tokens per reply.")
    p.add_argument("--system", default=None, help="System prompt.")
    p.add_argument("--draft-vocab", default=None, help="Draft vocabulary file, or 'none' (default: the drafter's own).")
    p.add_argument("--no-draft", action="store_true", help="Start in baseline mode (target only; /baseline toggles).")
    p.add_argument(
        "--prompt-cache-file", default=None, help="A prefix saved by dflash cache-prompt: the conversation follows it."
    )
    add_arguments(p, FIELDS)
    return p


def app_from_args(argv: list[str] | None = None) -> ChatApp:
    """The app the command line asks for; a bad option is an `OptionError` naming it."""
    args = build_parser().parse_args(argv)
    settings = Settings(from_args(args, FIELDS), max_tokens=args.max_tokens, baseline=args.no_draft)
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
    another target or drafter (one saved for the target alone fits), before the app starts."""
    if app.prompt_cache_file is not None:
        from dflash_mlx.cache import cache_ids, read_file

        read_file(app.prompt_cache_file, *cache_ids(app.model_path, app.draft_path), target_alone=True)


def main(argv: list[str] | None = None) -> None:
    """The `dflash-chat` console script: a bad flag is one line and exit code 1."""
    try:
        app = app_from_args(argv)
        check_prompt_cache(app)
    except OptionError as e:  # one line naming the flag, exit code 1
        sys.exit(f"dflash-chat: error: {flag_error(e)}")
    except ValueError as e:
        sys.exit(f"dflash-chat: error: {e}")
    app.run()
    sys.exit(app.return_code or 0)  # 1: a flag the loaded drafter refused (`ChatApp.check_block_size`)


if __name__ == "__main__":
    main()
