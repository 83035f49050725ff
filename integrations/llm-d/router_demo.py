"""tpusync's reference scorer (tpusync.core.routing) on two live pods, without llm-d.

Pod "hot" has a 2-block prefix in accelerator memory (plain vLLM events, no medium); pod "warm"
has the whole 8-block prefix in tpusync's host and disk tiers. The request goes to "warm".
Prints the scores; exit status 0 when the router picked "warm".
"""

from __future__ import annotations

import tempfile

import numpy as np

import tpusync.core as tc
from tpusync.core.events import AllBlocksCleared, BlockStored, KVEventPublisher, StoreEventBridge
from tpusync.core.routing import KVEventSubscriber, PrefixIndex


def main() -> int:
    prefix = [bytes([i]) * 32 for i in range(8)]
    index = PrefixIndex({None: 1.0, "GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "REMOTE": 0.3})
    with tempfile.TemporaryDirectory() as disk:
        store = tc.KVStore(4096, 3, disk_dir=disk, disk_blocks=64, writeback_batch=1)
        hot = KVEventPublisher("tcp://127.0.0.1:*", pod_id="hot", model="demo")
        warm = KVEventPublisher("tcp://127.0.0.1:*", pod_id="warm", model="demo")
        sub = KVEventSubscriber([hot.endpoint, warm.endpoint], index)
        # ZMQ drops what a PUB sends before the subscription arrives: wait for both streams.
        while {s.split("@")[0] for s in sub.streams} != {"hot", "warm"}:
            hot.publish([AllBlocksCleared()])
            warm.publish([AllBlocksCleared()])
            sub.poll(0.1)
        bridge = StoreEventBridge(store, warm, block_size=16, interval_s=None)
        hot.publish([BlockStored(prefix[:2], None, list(range(32)), 16, None, None)])
        store.put(prefix, np.zeros((8, 4096), np.uint8)).result(10)
        store.flush(10)
        bridge.pump()
        sub.wait_for(lambda: all(index.score(prefix, ["hot", "warm"]).values()), 10)
        scores = index.score(prefix, ["hot", "warm"])
        choice = index.best(prefix, ["hot", "warm"])
        for pod in ("hot", "warm"):
            media = sorted({m or "GPU" for h in prefix for m in index.media(h).get(pod, ())})
            print(f"pod {pod:4}: score {scores[pod]:.1f} (media {', '.join(media)})")
        print(f"route to: {choice}")
        for c in (bridge, sub, hot, warm, store):
            c.close()
    return 0 if choice == "warm" else 1


if __name__ == "__main__":
    raise SystemExit(main())
