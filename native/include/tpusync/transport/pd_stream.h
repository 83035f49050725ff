// The prefill/decode (P/D) streaming primitive: a producer hands pool blocks to the transport
// under a request id, a consumer pulls them into its own pool blocks, group by group (layer by
// layer), and both sides poll per-request results.
//
//   producer: RegisterSend(request_id, blocks, blocks_per_group, deadline)
//   consumer: StartRecv(request_id, {(peer, destination blocks), ...}, deadline) ... Poll()
//             or Recv(...) - the same, run to completion on the calling thread
//
// GROUP CONTRACT: the producer sends group 0 (blocks [0, blocks_per_group)) on every stream of the
// link before group 1, and so on; the consumer publishes `groups_ready` (the leading run of groups
// whose every block landed and passed its checksum, from every source), so it can start copying
// layer 0 while later layers are still on the wire.
//
// OWNERSHIP CONTRACT: RegisterSend takes its own reference on every block (Retain); the caller may
// free its reference at once. The producer drops that reference only when the consumer
// acknowledged a complete, verified receipt or the request's deadline passed, so a block is never
// recycled while a consumer may still read it (also on the same-host path, where the consumer
// copies straight out of the producer's /dev/shm pool). The consumer borrows its destination
// blocks for the duration of the receive.
//
// COMPLETION CONTRACT: a consumer request is done only when every declared source landed every one
// of its blocks; the first failure of any source fails the request with that reason (kCorrupted,
// kTimeout, kUnavailable, kNotFound...). A failed receipt is acknowledged as failed, and the
// producer keeps the blocks registered until the deadline, so the consumer may pull again.
//
// CHECKSUM CONTRACT: RegisterSend may be given one checksum (Checksum64 of the whole block) per
// block, computed where the bytes were made. The producer then sends those values instead of
// hashing the blocks again (in each kPdData frame, and after the offsets of a kPdShmOffer); the
// consumer verifies every block against them either way (on the same-host path right after its
// memcpy) and reports them in PdStatus::checksums, so a consumer that forwards the blocks passes
// the same values on and one hash pass, made once at the origin, is checked at every hop.
// Without them the producer hashes each block at send time (TCP) and the same-host path carries
// no checksum (PdStatus::checksums stays empty). Rejected alternative: a per-hop hash - every
// forwarder re-hashed what it received, a pass per hop that also could not catch damage done in
// a forwarder's memory.
//
// CANCEL CONTRACT: Cancel(request_id, reason) ends a registered send as failed at once (e.g. its
// consumer was found dead by a layer above): Poll reports it once, kFailed with `reason`, like an
// expiry, and the producer drops its reference on the blocks (OWNERSHIP CONTRACT). A pull of that
// request already on a serving thread holds a borrow on the blocks (LIFETIME CONTRACT of
// BlockAllocator), taken under the producer's lock while the request was still registered, so
// the slots return to the free list only when the last such pull let go of them: never while a
// socket send still reads them. Cancel shuts the TCP links serving the request down, so those
// sends fail and let go at once instead of at the deadline; a link whose pull already sent its
// last byte (only the consumer's ack is awaited, bounded by the deadline) stays open: the
// consumer may have put it back in its pool already, and a shut link would fail its next pull. A
// same-host pull keeps its borrow until the consumer acknowledges or its socket closes (at once
// when its process died): the consumer copies straight out of our segment after the offer, and only
// its ack or its socket says it stopped reading. A pull that arrives after Cancel is refused
// (kNotFound). Rejected alternative: Cancel waits for in-flight pulls to end before it returns - a
// send to a dead host blocks in the kernel until its deadline, which is the stall Cancel exists to
// end.
//
// ABANDON CONTRACT: a consumer that gives up on a request for good (its decode request was
// aborted) calls PdConsumer::Abandon(request_id, reason). Locally, at once: the request fails
// with `reason` (Poll / Wait / Recv report it), its links are shut down so every source stops,
// Abandon waits (bounded) until no source is inside its write phase, then returns the borrow of
// the destination blocks - so no destination block is written after Abandon returned OK, and the
// caller may free or reuse them. Then, best-effort, it tells every source producer with a
// kPdRelease frame on a link of its own; the producer ends that send like Cancel (kFailed, the
// reason naming the consumer's release, the TCP links serving it shut down) and drops its
// reference on the blocks at once instead of at the deadline (OWNERSHIP CONTRACT). Every wait is
// bounded by PdConsumerOptions::abandon_timeout: a dead or unreachable producer only shows up as
// a failed PdRelease entry, its own deadline stays the backstop. A producer that does not know
// the request (never registered, already acknowledged, expired, cancelled or released) answers
// kNotFound and changes nothing; a malformed release is refused (kInvalidArgument) and loses
// nothing. A failed receipt (COMPLETION CONTRACT) is still kept by the producer for a retry: only
// an explicit Abandon says there will be none. Rejected alternatives: a flag on the final kPdAck
// (the abandoned receive's link is the one shut down to stop it, and a receive that never
// reached the producer has no ack to carry it); waiting for in-flight sources without shutting
// their links (a receive stalled on a dead peer would hold Abandon to the request's deadline).
//
// SHARED-SEND CONTRACT: one registered send may be pulled by several consumers, each needing the
// whole of it (e.g. the decode ranks of a larger tensor-parallel group, each taking its heads out
// of one prefill rank's blocks). Each consumer names the number of readers in its pull
// (PdSource::readers; all must name the same number, a pull naming another one is refused with
// kInvalidArgument); the producer ends the send (done) after that many OK acknowledgements, or
// at its deadline. A failed receipt counts nothing (the consumer may pull again), and an Abandon
// from any one reader ends the send for all of them (ABANDON CONTRACT: its request was aborted,
// and every reader belongs to that request). The field travels only when it is above 1, so a
// single-reader pull is the frame it always was. Rejected alternative: the producer registers
// the send once per reader - it does not know the consumers' layout when it registers, and
// registrations nobody pulls would hold the blocks until the deadline.
//
// RELAY CONTRACT (cut-through forwarding): a process that receives blocks and passes them on (a
// sampler forwarding a weight bucket down a chain) registers the onward send before the blocks
// exist with RegisterRelay(request_id, num_blocks, ...) and hands each block over as it lands with
// Open(request_id, first, blocks, checksums) - usually from PdConsumer's `on_landed` callback
// (StartRecv), on the receiving thread, right after the block was verified. A pull of a relay send
// waits, frame by frame, until the blocks of that frame are open (bounded by the send's deadline;
// Cancel, expiry and Stop end the wait), so the next hop starts while the bucket is still on the
// wire and a chain adds one block's share of a stream per hop instead of one whole bucket. The
// same-host path waits until every block is open (its offer names all offsets at once). Open
// takes the producer's own reference on each block (OWNERSHIP CONTRACT) and needs the origin's
// checksum of each (CHECKSUM CONTRACT: the next hop checks the origin's hash). Opening a block
// that is already open changes nothing, so a receive that is retried, or re-pulled from another
// source into other destination blocks, may feed the same relay: blocks already handed over keep
// the first copy. A relay whose blocks never come is ended by its deadline or by Cancel. Errors:
// kNotFound (no live relay with that id), kInvalidArgument (not a relay, blocks out of range,
// checksums not one per block). Rejected alternatives: registering the onward send once the
// bucket landed (each hop then added more than a bucket-time: on 2 Gbit/s emulated hosts with
// 32 MiB buckets the last of 4 chained samplers finished 0.15-0.31 s per hop after the first,
// 45-140 ms with relays; docs/rl.md), and smaller buckets (less lag on links before relays but
// 7-9% slower on loopback from the per-bucket round trips; no gain on links with relays).
//
// SAME-HOST PATH: when the consumer reaches the producer through its Unix socket and the producer's
// pool lives in /dev/shm, the producer passes the segment's file descriptor (SCM_RIGHTS) and block
// offsets, and the consumer memcpys from the mapping; no TCP, no socket copy.
//
// Rejected alternative: push (the producer connects to the consumer). The consumer knows when its
// destination blocks exist; pull lets it allocate first and lets one producer serve retries.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/memory/block_allocator.h"
#include "tpusync/transport/link.h"

namespace tpusync::transport {

using memory::BlockAllocator;
using memory::BlockId;

enum class PdState : uint8_t { kPending = 0, kDone = 1, kFailed = 2 };
std::string_view PdStateName(PdState s);

struct PdStatus {
  uint64_t request_id = 0;
  PdState state = PdState::kPending;
  Status reason;              // why it failed (OK otherwise)
  uint32_t groups_total = 0;  // consumer: known once the first frame of every source arrived
  uint32_t groups_ready = 0;  // consumer: leading groups complete from every source
  uint64_t bytes = 0;         // payload bytes moved so far
  bool shm = false;           // the same-host shared-memory path was used
  // Consumer, once done: the verified checksum of every destination block, in StartRecv order
  // (sources in order); empty unless every block carried one (CHECKSUM CONTRACT).
  std::vector<uint64_t> checksums;
};

struct PdProducerOptions {
  std::string listen = "127.0.0.1:0";  // TCP address
  std::string unix_path;               // optional: also listen here (same-host peers)
  ServerOptions server;                // handshake timeout, socket options, fault wrapper
  // How long a pull may wait for RegisterSend (bounded, so pulls of ids that never come cannot
  // hold serving threads): a receive started earlier than this before the registration fails
  // kNotFound, the message naming both waits, whatever its own deadline.
  std::chrono::milliseconds max_pull_wait{10000};
  // HASH-AHEAD CONTRACT (pd_stream.cc): pulls on links with fewer streams than this get a hasher
  // thread per stream when they carry no origin checksums; 0 = the number of hardware threads
  // (a hasher only helps while a core would otherwise idle). Tests set it to force the path.
  size_t hash_ahead_below_streams = 0;
};

class PdProducer {
 public:
  static Result<std::unique_ptr<PdProducer>> Start(std::shared_ptr<BlockAllocator> pool,
                                                   Secret secret, PdProducerOptions options);
  ~PdProducer();
  Address address() const { return tcp_->address(); }
  std::string unix_address() const { return unix_ ? unix_->address().ToString() : ""; }

  // blocks_per_group 0: one group. kAlreadyExists for a live request id. `checksums`: empty, or
  // Checksum64 of each block (CHECKSUM CONTRACT), which the producer sends instead of hashing.
  Status RegisterSend(uint64_t request_id, std::vector<BlockId> blocks, uint32_t blocks_per_group,
                      Deadline deadline, std::vector<uint64_t> checksums = {});
  // RELAY CONTRACT: a send of `num_blocks` blocks that are handed over later by Open.
  Status RegisterRelay(uint64_t request_id, uint32_t num_blocks, uint32_t blocks_per_group,
                       Deadline deadline);
  // RELAY CONTRACT: blocks [first, first + blocks.size()) of relay `request_id` landed, verified,
  // with these origin checksums (one per block).
  Status Open(uint64_t request_id, uint32_t first, std::span<const BlockId> blocks,
              std::span<const uint64_t> checksums);
  // CANCEL CONTRACT: ends a registered send as failed with `reason` (which must not be OK) at
  // once. SAME-HOST HOLD: a same-host consumer already copying out of the segment keeps the
  // slots borrowed (out of the free list) until it acknowledged or its socket closed, past a
  // Cancel and past the deadline; a Stop under it keeps them out of the pool for good (logged).
  // kNotFound when `request_id` is not registered (never was, or already done / expired /
  // cancelled: each request ends once).
  Status Cancel(uint64_t request_id, Status reason);
  // Every request; terminal ones (done / failed) are reported once and then forgotten.
  std::vector<PdStatus> Poll();
  size_t pending() const;
  void Stop();

 private:
  struct Entry;
  PdProducer() = default;
  void ServeLink(const std::shared_ptr<Link>& link, bool is_unix);
  // ABANDON CONTRACT: a consumer's kPdRelease; the status to send back.
  Status ServeRelease(const InFrame& release, const std::string& peer);
  Status Register(std::shared_ptr<Entry> e, uint32_t blocks_per_group);
  Status CancelLocked(uint64_t request_id, Status reason, std::string_view verb);  // mu_ held
  Status ServePull(Link& link, bool is_unix, const InFrame& pull);
  void ReapLoop();
  void Finish(uint64_t request_id, Status reason);  // mu_ held

  std::shared_ptr<BlockAllocator> pool_;
  PdProducerOptions options_;
  std::unique_ptr<Server> tcp_, unix_;
  Fd shm_fd_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // a registration arrived (pulls waiting for one)
  // The reaper's own: woken only by Stop. Rejected alternative: sharing cv_ - every RegisterSend
  // and every finished request then woke the reaper too, a thread switch on each small pull.
  std::condition_variable reap_cv_;
  std::map<uint64_t, std::shared_ptr<Entry>> entries_;
  // ENDED RULE: the failure of the last kRecentlyEnded requests that ended without an
  // acknowledgement (cancelled, released, expired, producer stopped), so a pull that arrives
  // after the end fails at once with that reason; it waited max_pull_wait (10 s) for a
  // registration that could not come, then said "not registered". A new registration of the id
  // forgets it.
  static constexpr size_t kRecentlyEnded = 4096;
  std::map<uint64_t, Status> ended_;
  std::deque<uint64_t> ended_order_;
  std::vector<PdStatus> finished_;
  bool stop_ = false;
  std::thread reaper_;
};

struct PdSource {
  std::string peer;             // "HOST:PORT" or "unix:/path" of a producer
  std::vector<BlockId> blocks;  // destination blocks, same count as the producer registered
  uint32_t readers = 1;         // consumers that each pull this send (SHARED-SEND CONTRACT)
};

// One producer's answer to an Abandon (ABANDON CONTRACT): OK when it dropped its blocks;
// kNotFound when the request was not live there; otherwise why it could not be told.
struct PdRelease {
  std::string peer;
  Status status;
};

// RELAY CONTRACT: called by a receive on its own thread (no lock held) each time destination
// blocks [first, first + blocks.size()) of the request (sources in order) landed and passed their
// checksum, with those checksums. It must not block for long: it delays that stream's next read.
using PdLanded = std::function<void(uint32_t first, std::span<const BlockId> blocks,
                                    std::span<const uint64_t> checksums)>;

struct PdConsumerOptions {
  ConnectOptions connect;  // streams per link, timeouts, socket options, fault wrapper
  // SMALL-PULL CONTRACT: a source of at most this many payload bytes is pulled over a 1-stream link
  // (its own pool of warm links), so the producer sends it on one stream with no sender threads
  // and the consumer reads it with no reader threads; larger sources keep the striped
  // `connect.streams` path. 0 disables it. Rejected alternative: a flag in PdPull telling the
  // producer to use one stream of a wide link - a wire change for what a second pool gives free.
  size_t small_pull_bytes = size_t{256} << 10;
  // ABANDON CONTRACT: the bound of each wait of Abandon (local sources stopping; telling each
  // producer, which happens in parallel).
  std::chrono::milliseconds abandon_timeout{2000};
};

class PdConsumer {
 public:
  static Result<std::unique_ptr<PdConsumer>> Create(std::shared_ptr<BlockAllocator> pool,
                                                    Secret secret, PdConsumerOptions options);
  ~PdConsumer();
  // `on_landed` (optional): RELAY CONTRACT.
  Status StartRecv(uint64_t request_id, std::vector<PdSource> sources, Deadline deadline,
                   PdLanded on_landed = {});
  // INLINE CONTRACT: StartRecv + Wait for the whole request, with the first source pulled on the
  // calling thread (no hand-off to a worker and back: a small pull costs the two socket wake-ups of
  // a plain round trip); other sources run on workers as with StartRecv. Returns by `deadline`
  // plus the time a socket needs to notice it; a terminal request is reported here and not again
  // by Poll. Rejected alternative: running StartRecv inline - StartRecv must return at once, since
  // a consumer may start a receive before the producer registers the send (up to max_pull_wait).
  Result<PdStatus> Recv(uint64_t request_id, std::vector<PdSource> sources, Deadline deadline);
  // ABANDON CONTRACT: ends request `request_id` as failed with `reason` (not OK) and tells its
  // producers to drop their blocks. Errors: kInvalidArgument (OK reason), kNotFound (not
  // receiving here, or already reported), kFailedPrecondition (it already completed: nothing to
  // abandon, Poll reports it done), kTimeout (a source did not stop within abandon_timeout: it may
  // still write its destination blocks until it stops; the caller may free them - the borrow
  // keeps the slots out of the free list until then - but must not reuse their contents; the
  // producers were still told). Otherwise one PdRelease per distinct source producer.
  Result<std::vector<PdRelease>> Abandon(uint64_t request_id, Status reason);
  // Every request; terminal ones are reported once and then forgotten.
  //
  // FAIL-FAST CONTRACT: the first source of a request that fails stops the others (their links
  // are closed, queued ones never connect); the request is reported failed, with that source's
  // reason, once no source writes its blocks any more. DESTINATION CONTRACT: a receive whose
  // destination block another live receive still writes is refused (kInvalidArgument).
  std::vector<PdStatus> Poll();
  // Waits until `groups` groups are ready, the request ended, or the deadline passed.
  Result<PdStatus> Wait(uint64_t request_id, uint32_t groups, Deadline deadline);
  size_t idle_links() const { return links_.idle() + small_links_.idle(); }
  // Producer segments mapped for the same-host path (MAPPING CACHE: a removed one that no
  // receive uses is unmapped when the next new segment is mapped).
  size_t mapped_segments() const;

 private:
  struct Request;
  struct Source;
  struct Mapping;
  PdConsumer(std::shared_ptr<BlockAllocator> pool, Secret secret, PdConsumerOptions options);
  // Validates and registers a request (borrowing its destinations); queues sources [first, n).
  Result<std::shared_ptr<Request>> Begin(uint64_t request_id, std::vector<PdSource> sources,
                                         Deadline deadline, size_t first_queued,
                                         PdLanded on_landed);
  void RunSource(std::shared_ptr<Request> req, size_t index);
  Status PullFrom(Request& req, Source& src, Link& link);
  Result<std::shared_ptr<Mapping>> MapSegment(Fd fd);
  Status TellProducer(const Address& peer, uint64_t request_id, const Status& reason,
                      Deadline deadline);
  void Update(Request& req);  // mu_ held
  // Returns the destination borrow once and frees the blocks for other receives (mu_ held).
  void ReleaseDestinations(Request& req);

  std::shared_ptr<BlockAllocator> pool_;
  size_t small_pull_bytes_ = 0;  // 0: every source uses links_
  LinkPool links_;
  LinkPool small_links_;  // 1-stream links for small sources (SMALL-PULL CONTRACT)
  std::chrono::milliseconds abandon_timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Request>> requests_;
  // DESTINATION CONTRACT: block -> the live receive writing it (mu_; until its borrow ends).
  std::map<BlockId, uint64_t> receiving_;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Mapping>> mappings_;
  // WORKER CONTRACT: each source of a request runs on its own worker for the whole transfer (it
  // blocks on sockets); workers are kept and reused, so a small pull costs no thread creation. A
  // new worker starts only when every existing one is busy. Rejected alternative: a thread per
  // source per request (the old way) - its creation dominated the 16 KiB round trip.
  void WorkerLoop();
  struct Job {
    std::shared_ptr<Request> req;
    size_t index = 0;
  };
  std::deque<Job> jobs_;     // mu_
  size_t idle_workers_ = 0;  // mu_
  size_t spawning_ = 0;      // mu_: started workers not yet waiting
  bool stopping_ = false;    // mu_
  std::condition_variable work_cv_;
  std::vector<std::thread> workers_;
};

}  // namespace tpusync::transport
