// Versions of the native core.
//
// API CONTRACT: kApiVersion is an integer that grows by one each time the Python-visible surface of
// tpusync-core gains or changes something a framework package may rely on. Framework wheels
// (tpusync-torch, -jax, -vllm, -rl) state the lowest API version they need and refuse to import
// against an older core with a clear message. The release version string (e.g. "0.1.0") is only
// for humans and wheels; compatibility checks use kApiVersion.
//
// History (one line per bump):
//   1: base / memory / block / engine: BlockPool, BlockIndex, Engine, futures, DLPack views.
//   2: KVStore (host + disk tiers, warm restart), segment gather/scatter, P/D producer/consumer,
//      store node + client, checksum64 over arrays.
//   3: BlockPool.borrow (batch borrows for DMA issued outside the core, e.g. CUDA streams);
//      KVStore remote tier (open_remote_kv_store), placement events (enable_events /
//      take_events), BlockIndex.reserve / lookup_prefix_array, store-node disk tier and read
//      leases (StoreNode.start(disk_dir=...), StoreClient.lookup_prefix(lease=...)).
//   4: KVStore write_through (open / open_remote_kv_store, write_through_* stats); P/D origin
//      checksums (PdProducer.register_send(checksums=...), PdStatus.checksums); PdConsumer.recv
//      (pull on the calling thread) and small_pull_bytes; StoreNode.start(name_space=,
//      fingerprint=) warm restart, cold_start_reason, recovered_blocks.
//   5: BlockIndex recency modes (Recency.CLOCK default, Recency.EXACT_LRU; BlockIndex(recency=),
//      BlockIndex.recency); eviction_candidates may reorder a CLOCK index; /dev/shm pools collapse
//      to huge pages in the background (BlockPool.wait_huge_pages, host tier stats "huge_pages").
//   6: KVStore recency from Python (KVStoreNative.open / open_remote_kv_store index_recency=,
//      KVStoreNative.index_recency; KVStore(recency=), KVStore.recency);
//      bench.common.measure_paired; KVCacheManagerBase checks a whole call's host ids once, up
//      front (_checked_host_ids).
//   7: kvcache.weights.HostWeights (one class for the torch and jax weight-sync device sides);
//      copy_checksum64 and Checksum64Stream (update, copy_update with keep_in_cache, digest).
//   8: Checksum64Stream.cast_update (float32 -> bfloat16 staging in the hash pass); disk tier
//      clean-shutdown manifest (tier stats "recovery": cold / scan / manifest, "manifest_errors");
//      PdProducer.cancel (end a registered send at once, its blocks freed when no pull holds them).
//   9: Checksum64Stream.cast_update also casts float32 -> float16 (dst dtype float16); disk tier
//      checkpoints while serving plus a slot journal (KVStoreNative.open / open_remote_kv_store
//      disk_checkpoint_s= / disk_checkpoint_writes=, KVStore(checkpoint_s=, checkpoint_writes=);
//      disk stats recovery "checkpoint", recovery_slots_read, checkpoints, journaled);
//      KVStore.checkpoint() (checkpoint the disk tier now); a cold disk tier checkpoints at open.
//  10: PdConsumer.abandon (a consumer that gives up tells its producers to drop the request's
//      blocks at once; PdConsumer(abandon_timeout=), pd.PdRelease); the checkpoint manifest is
//      written back progressively (DiskTierOptions::manifest_progressive_write_back, C++ only).
//  11: the manifest write-back mode reaches Python (KVStoreNative.open /
//      open_remote_kv_store(disk_manifest_progressive_write_back=), KVStore(checkpoint_write_back=
//      "progressive" | "at_fsync")) and the disk tier's stats name it (manifest_write_back).
//  12: reclaim_stale_segments(prefix) and shm_segments(prefix) (OWNER LOCK CONTRACT: a /dev/shm
//      pool holds a shared flock on its segment while it lives; segments of killed owners can be
//      told apart, listed and removed; `tpusync shm list | reclaim`).
//  13: shared P/D sends (SHARED-SEND CONTRACT: PdConsumer.start_recv / recv sources may name
//      their number of readers, `readers=` natively; the producer ends a send after that many
//      verified receipts).
//  14: pd.host_id (the same-host identity the vLLM and SGLang P/D paths compare; it lived in
//      tpusync-vllm and was copied into the SGLang integration).
//  15: pd.pair_layers (the LAYER PAIRING CONTRACT both P/D integrations follow when the prefill
//      and the decode split the model into different pipeline stages).
#pragma once

namespace tpusync {

inline constexpr int kApiVersion = 15;

#ifndef TPUSYNC_VERSION_STRING
#define TPUSYNC_VERSION_STRING "0.0.0+unknown"
#endif
inline constexpr const char* kVersionString = TPUSYNC_VERSION_STRING;

}  // namespace tpusync
