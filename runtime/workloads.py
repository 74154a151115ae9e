"""Reproducible request sets for benchmarks and tests, in the `pagedgraph generate --input` JSONL format."""
from __future__ import annotations

import random
from typing import Any

_WORDS = (
    "account order refund policy customer shipping warehouse invoice payment delivery return label carrier "
    "package tracking address support ticket agent priority escalation manager response time business day "
    "holiday weekend exchange warranty repair replacement damaged missing item product service plan "
    "subscription renewal cancellation fee discount coupon code loyalty points balance statement receipt "
    "confirmation email phone chat message record note history status update request approval review "
    "limit threshold amount currency region country store online partner supplier stock inventory backorder "
    "estimate window schedule pickup dropoff signature verification identity security password reset"
).split()
_QUESTIONS = (
    "How long does a refund take for order {n}?",
    "Can I change the delivery address of package {n}?",
    "What happens if item {n} arrives damaged?",
    "Is there a fee to cancel subscription {n}?",
    "How do I escalate ticket {n} to a manager?",
    "When will backorder {n} ship?",
    "Can coupon {n} be combined with loyalty points?",
    "Why was payment {n} declined?",
)


def _policy_text(rng: random.Random, num_words: int) -> str:
    """Sentences of 8-16 words drawn from a fixed vocabulary until `num_words` words are written."""
    sentences, written = [], 0
    while written < num_words:
        length = min(rng.randint(8, 16), num_words - written)
        words = [rng.choice(_WORDS) for _ in range(length)]
        sentences.append(" ".join(words).capitalize() + ".")
        written += length
    return " ".join(sentences)


def shared_prefix_workload(num_requests: int = 32, prefix_words: int = 860, max_tokens: int = 32,
                           seed: int = 0, prefixes: int = 1) -> list[dict[str, Any]]:
    """Chat requests that share a long system prompt and differ in their question (greedy).

    With the default 860 words the system prompt renders to about 1,000 SmolLM2 tokens, so all
    but the first request can take the shared blocks from the prefix cache. With `prefixes` > 1 there
    are that many system prompts (tenants), each request drawing one at random: what a router must keep
    together for the replicas' caches to hit. Each item is a request of `pagedgraph generate --input`
    (messages plus sampling fields).
    """
    rng = random.Random(seed)
    systems = ["You are the support assistant of an online store. Follow this policy.\n" +
               _policy_text(rng, prefix_words) for _ in range(prefixes)]
    items = []
    for _ in range(num_requests):
        system = systems[rng.randrange(prefixes)] if prefixes > 1 else systems[0]
        question = rng.choice(_QUESTIONS).format(n=rng.randint(1000, 9999))
        items.append({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                      "max_tokens": max_tokens, "temperature": 0.0})
    return items


def _typo(rng: random.Random, word: str) -> str:
    """`word` with two neighbouring letters swapped (words of 4+ letters)."""
    if len(word) < 4:
        return word
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def _code(rng: random.Random, name: str) -> str:
    fields = rng.sample(_WORDS, 4)
    lines = [f"def update_{name}({name}, {fields[0]}, {fields[1]}):",
             f"    \"\"\"Apply the {fields[2]} rules to {name}.\"\"\""]
    for field in fields:
        lines.append(f"    if {name}.{field} is None:")
        lines.append(f"        {name}.{field} = {fields[0]}.{field} + {fields[1]}")
    lines.append(f"    return {name}")
    return "\n".join(lines)


def copy_heavy_workload(num_requests: int = 8, seed: int = 0) -> list[tuple[list[dict[str, str]], str]]:
    """Chats whose answer quotes the prompt (what n-gram speculation is for): rename a variable in a function,
    fix the typos of a paragraph, copy the matching records of a list. Each item: the messages and the text the
    answer quotes (its length sizes max_tokens)."""
    rng = random.Random(seed)
    items = []
    for i in range(num_requests):
        kind = i % 3
        if kind == 0:
            old, new = rng.sample(_WORDS, 2)
            code = _code(rng, old)
            ask = f"Rename the variable `{old}` to `{new}` in this function and return the whole function.\n\n{code}"
            quoted = code.replace(old, new)
        elif kind == 1:
            text = _policy_text(rng, 70)
            noisy = " ".join(_typo(rng, w) if rng.random() < 0.2 else w for w in text.split())
            ask = f"Fix the typos in this text and return the corrected text only.\n\n{noisy}"
            quoted = text
        else:
            records = [f"{rng.choice(_WORDS)}-{rng.randint(100, 999)}: status {rng.choice(('open', 'closed'))}, "
                       f"owner {rng.choice(_WORDS)}, {rng.choice(_WORDS)} {rng.choice(_WORDS)}" for _ in range(14)]
            ask = "Copy every record whose status is open, unchanged, one per line.\n\n" + "\n".join(records)
            quoted = "\n".join(r for r in records if "status open" in r)
        items.append(([{"role": "user", "content": ask}], quoted))
    return items
