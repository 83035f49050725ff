#include "tpusync/tier/disk_journal.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "tpusync/base/checksum.h"
#include "tpusync/tier/file_write.h"

namespace tpusync::tier {
namespace {

namespace fs = std::filesystem;

constexpr char kPrefix[] = "journal-";
constexpr size_t kHexDigits = 16;

uint32_t RecordCheck(uint32_t slot, uint64_t generation) {
  const uint64_t v[2] = {slot, generation};
  return static_cast<uint32_t>(Checksum64(v, sizeof(v)));
}

// The generation a journal file name encodes, or false for any other name (.tmp included).
bool ParseName(const std::string& name, uint64_t* generation) {
  if (name.size() != sizeof(kPrefix) - 1 + kHexDigits || name.rfind(kPrefix, 0) != 0) return false;
  uint64_t g = 0;
  for (size_t i = sizeof(kPrefix) - 1; i < name.size(); ++i) {
    const char c = name[i];
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    g = g << 4 | static_cast<uint64_t>(d);
  }
  *generation = g;
  return true;
}

}  // namespace

std::string JournalPath(const std::string& dir, uint64_t generation) {
  char name[40];
  std::snprintf(name, sizeof(name), "%s%016" PRIx64, kPrefix, generation);
  return dir + "/" + name;
}

Result<std::unique_ptr<JournalWriter>> JournalWriter::Create(const std::string& dir,
                                                             uint64_t generation,
                                                             const DiskMeta& meta) {
  std::unique_ptr<JournalWriter> w(new JournalWriter());
  w->path_ = JournalPath(dir, generation);
  w->what_ = StrCat("journal ", w->path_);
  w->generation_ = generation;
  const std::string tmp = w->path_ + ".tmp";
  w->fd_ = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return Status::FromErrno(errno, StrCat("creating journal ", tmp));
  JournalHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kJournalMagic;
  h.version = kJournalVersion;
  h.generation = generation;
  h.meta_checksum = meta.header_checksum;
  h.header_checksum = Checksum64(&h, offsetof(JournalHeader, header_checksum));
  Status s = WriteAll(w->fd_, &h, sizeof(h), StrCat("journal ", tmp));
  if (s.ok() && rename(tmp.c_str(), w->path_.c_str()) != 0) {
    s = Status::FromErrno(errno, StrCat("renaming journal ", tmp));
  }
  if (!s.ok()) {
    unlink(tmp.c_str());
    return s;
  }
  return w;
}

JournalWriter::~JournalWriter() {
  if (fd_ >= 0) close(fd_);
}

Status JournalWriter::Append(std::span<const uint64_t> slots) {
  if (slots.empty()) return Status::OK();
  std::vector<JournalRecord> recs(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    recs[i].slot = static_cast<uint32_t>(slots[i]);
    recs[i].check = RecordCheck(recs[i].slot, generation_);
  }
  return WriteAll(fd_, recs.data(), recs.size() * sizeof(JournalRecord), what_);
}

std::vector<uint64_t> ListJournals(const std::string& dir) {
  std::vector<uint64_t> gens;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    uint64_t g = 0;
    if (ParseName(entry.path().filename().string(), &g)) gens.push_back(g);
  }
  std::sort(gens.begin(), gens.end());
  return gens;
}

Status ReadJournals(const std::string& dir, const DiskMeta& meta, uint64_t from,
                    uint64_t num_blocks, JournalContents* out) {
  out->slots.clear();
  out->last_generation = from;
  std::vector<uint64_t> gens = ListJournals(dir);
  gens.erase(gens.begin(), std::lower_bound(gens.begin(), gens.end(), from));
  if (gens.empty() || gens.front() != from) {
    return Status::Corrupted(StrCat("journal generation ", from, " is missing"));
  }
  for (size_t i = 0; i < gens.size(); ++i) {
    const uint64_t g = gens[i];
    if (g != from + i) {
      return Status::Corrupted(StrCat("journal generation ", from + i, " is missing (", g,
                                      " follows ", from + i - 1, ")"));
    }
    const std::string path = JournalPath(dir, g);
    TPUSYNC_ASSIGN_OR_RETURN(const ReadOnlyFile file, ReadOnlyFile::Open(path, "journal"));
    const uint64_t size = file.size();
    if (size < sizeof(JournalHeader) || (size - sizeof(JournalHeader)) % sizeof(JournalRecord)) {
      return Status::Corrupted(
          StrCat("journal ", g, " is truncated mid-record (", size, " bytes)"));
    }
    std::vector<uint8_t> buf(size);
    const ssize_t done = file.ReadAll(buf.data(), size);
    if (done < 0) {
      return Status::FromErrno(static_cast<int>(-done), StrCat("reading journal ", path));
    }
    if (static_cast<uint64_t>(done) != size)
      return Status::Corrupted(StrCat("journal ", g, " shrank while read"));
    JournalHeader h;
    std::memcpy(&h, buf.data(), sizeof(h));
    if (h.magic != kJournalMagic || h.version != kJournalVersion ||
        h.header_checksum != Checksum64(&h, offsetof(JournalHeader, header_checksum))) {
      return Status::Corrupted(StrCat("journal ", g, " header is damaged or of another version"));
    }
    if (h.generation != g) {
      return Status::Corrupted(
          StrCat("journal file of generation ", g, " holds generation ", h.generation));
    }
    if (h.meta_checksum != meta.header_checksum) {
      return Status::Corrupted(StrCat("journal ", g, " was written under another tier.meta"));
    }
    const size_t n = (size - sizeof(JournalHeader)) / sizeof(JournalRecord);
    for (size_t r = 0; r < n; ++r) {
      JournalRecord rec;
      std::memcpy(&rec, buf.data() + sizeof(JournalHeader) + r * sizeof(JournalRecord),
                  sizeof(rec));
      if (rec.check != RecordCheck(rec.slot, g) || rec.slot >= num_blocks) {
        return Status::Corrupted(StrCat("journal ", g, " record ", r, " is damaged"));
      }
      out->slots.push_back(rec.slot);
    }
    out->last_generation = g;
  }
  return Status::OK();
}

Status RemoveJournals(const std::string& dir, uint64_t below) {
  Status first;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    uint64_t g = 0;
    const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 &&
                     ParseName(name.substr(0, name.size() - 4), &g);
    if (!tmp && !ParseName(name, &g)) continue;
    if (g >= below) continue;
    if (unlink(entry.path().c_str()) != 0 && errno != ENOENT && first.ok()) {
      first = Status::FromErrno(errno, StrCat("removing journal ", entry.path().string()));
    }
  }
  return first;
}

}  // namespace tpusync::tier
