"""The adaptive policy's view, cycle by cycle: for each drafter, one policy across held-out
prompts (as the bench keeps one), each cycle's width, drafts accepted, seconds, and what the
policy believed when it chose (p_k estimates, chain costs, tree ratios and costs). A summary
line per prompt and drafter goes to stdout; the whole trace to a JSON file.

    python -m benchmarks.policy_trace --kinds chat,code --draft A --draft B --out trace.json

Drafters run in the order given on each prompt (the first one takes a cold process's first
cycles). Session 26 found with it that widths timed in a slow stretch were never timed again.
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

import argparse
import json

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.messages import apply_chat_template, read_prompt_file
from dflash_mlx.policy import Width
from dflash_mlx.tree_policy import TreePolicy


class TracedPolicy(TreePolicy):
    """A `TreePolicy` that keeps, for every finished cycle, what it saw and believed."""

    def __init__(self, max_size: int):
        super().__init__(max_size)
        self.trace: list[dict] = []

    def update_width(self, width: Width, accepted: int, seconds: float, chain=None) -> None:
        self.trace.append(
            {
                "width": str(width),
                "accepted": accepted,
                "ms": round(1000 * seconds, 1),
                "probe": self.probe is not None or self.tree_probe is not None,
                "p": [round(self.acceptance(k), 3) for k in range(1, self.max_size)],
                "chain_ms": [round(1000 * c, 1) for c in self.costs()],
                "tree_ratio": {n: round(self.ratio(n), 3) for n in self.trees},
                "tree_ms": {n: round(1000 * c.mean, 1) for n, c in self.tree_seconds.items()},
            }
        )
        super().update_width(width, accepted, seconds, chain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="chat,code", help="held-out kinds, comma-separated")
    parser.add_argument("--draft", action="append", required=True, help="a drafter (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="policy_trace.json")
    args = parser.parse_args()
    model, tokenizer = load()
    kinds = args.kinds.split(",")
    prompts = [p for p in read_prompt_file("assets/prompts/heldout.jsonl") if p.get("set") in kinds]
    drafters = {path: load_draft(path, model=model) for path in args.draft}
    policies = {path: TracedPolicy(d.config.block_size) for path, d in drafters.items()}
    for p in prompts:
        prompt = apply_chat_template(tokenizer, p["messages"], tokenize=False)
        for path, drafter in drafters.items():
            policies[path].trace.append({"prompt": p["id"]})
            *_, last = stream_generate(
                model, tokenizer, prompt, drafter, max_tokens=args.max_tokens, policy=policies[path]
            )
            stats = last.stats.to_dict()
            print(p["id"], path, f"tau {stats['committed_tokens'] / stats['cycles']:.2f}", stats["widths"], flush=True)
    with open(args.out, "w") as f:
        json.dump({path: policy.trace for path, policy in policies.items()}, f)


if __name__ == "__main__":
    main()
