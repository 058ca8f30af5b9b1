"""A small English corpus, written for this project, on which the local tokenizers are trained.

It ships inside the package (a module rather than a data file, so every install has it) and
is the only training input of :func:`engines.model_builder.build_model`'s tokenizer: no hub,
no downloads. Licence: the project's own (Apache-2.0). The text only has to cover common
English words, digits, punctuation and some code so that byte-level BPE learns useful merges.
"""

from __future__ import annotations

CORPUS = """\
A serving system receives requests from many tenants. Each request carries a prompt, and the
prompt is split into tokens before the engine sees it. The engine keeps a cache of key and value
tensors for the tokens it has already processed, arranged in fixed-size blocks. When a new prompt
begins with the same tokens as an earlier one, the engine can reuse those blocks and skip the
work of computing them again. This is called prefix caching, and it turns repeated system
prompts, shared documents and long conversations into cheap requests.

The scheduler decides which waiting request is admitted next. A first-come, first-served queue
is simple and fair in arrival order, but it ignores the cache: a cheap request that would hit a
long cached prefix may wait behind a long miss that takes many steps to compute. A longest
prefix match order does the opposite. It admits the best cache hits first, which keeps the cache
warm and the throughput high, but a request with no shared prefix may wait for a very long time.
A good policy balances both goals: it lets cheap hits go first while it bounds the wait of every
request in proportion to its own cost.

Time to first token measures how long a user waits before the answer begins. Inter-token latency
measures the gap between later tokens. Prefill is the phase that reads the whole prompt; decode
is the phase that writes one token per step for every running request. Prefill is limited by
compute, decode is often limited by memory bandwidth, and the two phases interfere when they run
on the same machine. Disaggregated serving runs them on different replicas and moves the cache
from the prefill replica to the decode replica over a fast network.

On the decode side, admission control decides how many requests may run together. A larger batch
raises throughput until the step time starts to grow; beyond that point every running request
slows down. A token window limits the total number of tokens in flight. The window opens while
the step time stays near its baseline and narrows when steps slow down, so the engine stays close
to the point where it is busy but not overloaded.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly
quick daft zebras jump! Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.
Numbers appear everywhere: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192
16384 32768 65536. Dates such as 2024-05-17 and times such as 09:30:00 are common in logs. Prices
look like $3.50 or 12.99 EUR, and ratios like 3:1 or 75%.

Questions and answers follow a simple pattern. Question: what is the capital of France? Answer:
Paris. Question: how many days are in a leap year? Answer: 366. Question: if a train travels 60
kilometres in one hour, how far does it travel in three hours? Answer: 180 kilometres. Question:
what is seven times eight? Answer: fifty-six. Please summarise the following document in three
sentences. Translate the next paragraph into plain language. Explain the steps of the proof.

User: Hello, can you help me plan a trip to the mountains next week?
Assistant: Of course. How many days do you have, and do you prefer hiking or a quiet stay?
User: Four days, and I would like some easy walks with good views.
Assistant: Then pick a valley town with a cable car, walk the lake trail on the first day, take
the cable car up on the second, visit the old village on the third, and keep the fourth free.

def schedule(waiting, budget):
    admitted = []
    for request in sorted(waiting, key=lambda r: r.arrival_time):
        cost = request.num_tokens - request.num_cached_tokens
        if cost > budget:
            break
        admitted.append(request)
        budget -= cost
    return admitted

class Window:
    def __init__(self, size: int, minimum: int, maximum: int) -> None:
        self.size = size
        self.minimum = minimum
        self.maximum = maximum

    def update(self, latency: float, baseline: float) -> int:
        if latency <= 1.1 * baseline:
            self.size = min(self.maximum, self.size * 2)
        else:
            self.size = max(self.minimum, self.size // 2)
        return self.size

{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
SELECT tenant, count(*) FROM requests WHERE ttft_ms > 500 GROUP BY tenant ORDER BY 2 DESC;

Rivers carry water from the hills to the sea. In spring the snow melts, the rivers rise, and the
fields along the banks turn green. Farmers plant wheat, barley, beans and potatoes; in autumn
they bring in the harvest and store it for the winter. Markets open early in the morning, and
people buy bread, cheese, apples, fish and flowers. Children walk to school, workers ride trains
to the city, and in the evening the streets fill with light and music.

Science advances by careful measurement. A good experiment changes one thing at a time, records
every result, and repeats the measurement until the noise is understood. A model that fits the
data is useful only if it also predicts new data. When the prediction fails, the model must be
changed, not the data. Engineers follow the same rule: measure first, then optimise the part that
is actually slow, and measure again to confirm that the change helped.

Libraries hold books on history, mathematics, physics, chemistry, biology, medicine, law, music,
art, philosophy and languages. A reader may borrow a book for three weeks and renew it twice.
Old maps show roads, rivers, forests and towns; new maps add railways, airports and power lines.
"""
