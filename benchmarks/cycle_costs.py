"""What a cycle of each width costs on this machine, as the adaptive policy measures it (its own
running averages), after decoding four held-out code prompts with one policy; each answer's
time with plain mlx-lm is printed beside ours.

    python -m benchmarks.cycle_costs   # from the repository root, on an idle machine
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

import time

import mlx_lm

from dflash_mlx import generate, load, load_draft, make_policy
from dflash_mlx.messages import apply_chat_template, read_prompt_file


def main() -> None:
    model, tokenizer = load()
    drafter = load_draft(None, model=model)
    prompts = [p for p in read_prompt_file("assets/prompts/heldout.jsonl") if p.get("set") == "code"][:4]
    policy = make_policy(model, drafter)
    for p in prompts:
        prompt = apply_chat_template(tokenizer, p["messages"], tokenize=False)
        tic = time.perf_counter()
        mlx_lm.generate(model, tokenizer, prompt, max_tokens=128)
        plain = time.perf_counter() - tic
        tic = time.perf_counter()
        generate(model, tokenizer, prompt, drafter, max_tokens=128, policy=policy)
        print(f"plain {plain:.2f} s, ours {time.perf_counter() - tic:.2f} s")
    print("chains (ms by size):", {k: round(1000 * v.mean, 1) for k, v in sorted(policy.seconds.items())})
    print("trees (ms by nodes):", {k: round(1000 * v.mean, 1) for k, v in sorted(policy.tree_seconds.items())})


if __name__ == "__main__":
    main()
