"""Announce a tpusync KVStore (host DRAM + disk tiers) to llm-d's indexer.

For engines without their own KV-event publisher (a custom engine, an SGLang deployment, a
cache-only node): every put, host->disk demotion, disk->host promotion, eviction and removal of
the store becomes a BlockStored / BlockRemoved event with the tier as ``medium``.

    python store_publisher.py --epp tcp://EPP_HOST:5557 --pod $POD_IP --model $MODEL

Keys put into the store must be the engine's own block hashes (llm-d matches them against the
hashes it computes from the prompt: vLLM's sha256_cbor with the same hash seed).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

import tpusync.core as tc
from tpusync.core.events import KVEventPublisher, StoreEventBridge


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--epp", required=True, help="llm-d's kvEventsConfig.zmqEndpoint, e.g. tcp://epp:5557"
    )
    ap.add_argument("--pod", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--seconds", type=float, default=5.0, help="demo duration")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as disk:
        store = tc.KVStore(4096, 8, disk_dir=disk, disk_blocks=256)
        # connect (bind=False): llm-d's indexer binds zmqEndpoint and every pod connects to it.
        pub = KVEventPublisher(args.epp, pod_id=args.pod, model=args.model, bind=False)
        # A PUB drops messages until the connection and the router's subscription are up (ZMQ's
        # slow joiner); a real engine starts long before its first blocks, this demo does not.
        time.sleep(0.5)
        with StoreEventBridge(store, pub, block_size=args.block_size):
            # Stand-in for an engine: 32 blocks, so 24 are demoted to the disk tier.
            keys = [i.to_bytes(8, "big") * 4 for i in range(32)]
            store.put(keys, np.zeros((32, 4096), np.uint8)).result(30)
            store.flush(30)
            time.sleep(args.seconds)
        pub.close()
        store.close()


if __name__ == "__main__":
    main()
