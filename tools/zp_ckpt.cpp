// zp_ckpt: list, inspect, verify, export, reshard and prune zp checkpoints offline (no GPU, no
// MPI, one process; memory: one parameter chunk or rank slice at a time, never the model).
//
//   zp_ckpt list    DIR
//   zp_ckpt info    DIR [--tag T]
//   zp_ckpt verify  DIR [--tag T]
//   zp_ckpt export  DIR OUT [--tag T] [--master] [--max-file-bytes N]
//   zp_ckpt reshard DIR --ranks M [--tag T] [--out-tag T2]
//   zp_ckpt prune   DIR --keep N
//
// Exit status: 0 success (and --help), 1 a failed check or I/O error (the message names the
// file), 2 usage (an unknown command or flag, a flag the command does not take or given twice).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <limits>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "zp/checkpoint_format.hpp"

namespace {

const char* usage =
    "usage: zp_ckpt list    DIR\n"
    "       zp_ckpt info    DIR [--tag T]\n"
    "       zp_ckpt verify  DIR [--tag T]\n"
    "       zp_ckpt export  DIR OUT [--tag T] [--master] [--max-file-bytes N]\n"
    "       zp_ckpt reshard DIR --ranks M [--tag T] [--out-tag T2]\n"
    "       zp_ckpt prune   DIR --keep N\n"
    "  DIR      a checkpoint directory (the one holding `latest`)\n"
    "  --tag    which checkpoint (default: the one `latest` names)\n"
    "  export   writes OUT/model.safetensors (T parameters; --master: fp32 master weights), split\n"
    "           into model-0000k-of-n files with an index above --max-file-bytes\n"
    "  list     every checkpoint in DIR by step, and what unfinished saves left\n"
    "  reshard  writes DIR/<out-tag> (default <tag>-<M>ranks) laid out for M ranks\n"
    "  prune    keeps the N newest checkpoints up to the one `latest` names, as a save's\n"
    "           retention does (later steps and unreadable ones stay), and removes what\n"
    "           crashed saves left; fails while a save into DIR runs\n";

// The commands and the options each takes.
struct Command {
  std::string_view name;
  std::vector<std::string_view> options;
};
const Command commands[] = {{"list", {}},
                            {"info", {"--tag"}},
                            {"verify", {"--tag"}},
                            {"export", {"--tag", "--master", "--max-file-bytes"}},
                            {"reshard", {"--tag", "--ranks", "--out-tag"}},
                            {"prune", {"--keep"}}};

[[noreturn]] void bad(const std::string& msg) {
  std::fprintf(stderr, "zp_ckpt: %s\n\n%s", msg.c_str(), usage);
  std::exit(2);
}

// A decimal integer in [lo, hi]; anything else (a sign where none fits, out of range, trailing
// text) names the flag, the value and the range, and exits with status 2.
long long to_number(const std::string& flag, const std::string& v, long long lo, long long hi) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno == ERANGE || x < lo || x > hi)
    bad(flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
        "], got '" + v + "'");
  return x;
}

bool takes(const Command& c, std::string_view option) {
  return std::find(c.options.begin(), c.options.end(), option) != c.options.end();
}

int info(zp::ckpt::Reader& rd) {
  const auto& m = rd.manifest();
  std::size_t elements = 0;
  for (const auto& p : m.params) elements += p.size;
  std::printf("checkpoint %s\n", rd.path().c_str());
  std::printf(
      "  saved by %d ranks (dp %d x tp %d x pp %d) at ZeRO stage %d, %s parameters, optimizer %s "
      "%s\n",
      m.world_size, m.grid.dp, m.grid.tp, m.grid.pp, m.stage, zp::name(m.dtype),
      zp::detail::text_excerpt(m.optimizer).c_str(), m.hyper.dump().c_str());
  std::printf("  %zu parameters, %zu elements in %d modules; fields:", m.params.size(), elements,
              m.params.back().module + 1);
  // (names from the manifest: shortened, control characters escaped)
  for (const auto& f : m.fields) std::printf(" %s", zp::detail::text_excerpt(f).c_str());
  if (!m.no_weight_decay.empty()) {
    const std::size_t n = m.no_weight_decay.size(), shown = std::min<std::size_t>(n, 8);
    std::printf("\n  no weight decay on %zu of them:", n);
    for (std::size_t i = 0; i < shown; ++i)
      std::printf(" %s", zp::detail::text_excerpt(m.no_weight_decay[i]).c_str());
    if (shown < n) std::printf(" ... (%zu more)", n - shown);
  }
  std::printf(
      "\n  step %lld, loss scale %g (%lld skipped, %lld of them in a row), user data %llu "
      "bytes\n",
      static_cast<long long>(m.step), double(m.scaler.scale),
      static_cast<long long>(m.scaler.skipped), static_cast<long long>(m.scaler.skipped_in_row),
      static_cast<unsigned long long>(m.user_bytes));
  for (const auto& f : m.files)
    std::printf("  %s  %llu bytes  crc32c %08x\n", f.name.c_str(),
                static_cast<unsigned long long>(f.bytes), f.crc32c);
  return 0;
}

// A long verify, export or reshard says where it is: a line on stderr every 5 s (one of a few GB
// ends before the first). `done`: what the bytes are ("read", "written").
zp::ckpt::Progress progress_lines(const char* what, const char* done_what = "written") {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  return [what, done_what, start, next = start + std::chrono::seconds(5)](
             std::uint64_t done, std::uint64_t total) mutable {
    const auto now = clock::now();
    if (now < next) return;
    next = now + std::chrono::seconds(5);
    const double secs = std::chrono::duration<double>(now - start).count();
    std::fprintf(stderr, "zp_ckpt: %s: %.2f of %.2f GB %s (%.0f%%), %.0f MB/s\n", what,
                 double(done) / 1e9, double(total) / 1e9, done_what,
                 total ? 100.0 * double(done) / double(total) : 100.0, double(done) / 1e6 / secs);
  };
}

// "1.23 GB": bytes with three significant digits.
std::string size_text(std::uint64_t bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  double x = double(bytes);
  int u = 0;
  for (; x >= 999.5 && u < 5; ++u) x /= 1000;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.3g %s" : "%.0f %s", x, units[u]);
  return buf;
}

// A name found in a checkpoint directory, as printed: whole, with control characters escaped
// (anyone may have made the entry).
std::string shown(const std::string& name) { return zp::detail::text_excerpt(name, SIZE_MAX); }

// Every checkpoint of `dir` in the order of training, as prune orders them
// (ckpt::checkpoints_in_order), unreadable ones last, then what unfinished saves left (or a save
// running now: list takes no lock).
int list(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) throw zp::Error(zp::Errc::io, "cannot list " + dir.string() + ": " + ec.message());
  std::string latest;
  try {
    latest = zp::ckpt::Reader::read_latest(dir);
  } catch (const zp::Error& e) {
    std::printf("%s\n", e.message().c_str());
  }
  struct Row {
    std::string tag, text;
  };
  std::vector<Row> rows;
  for (const auto& c : zp::ckpt::checkpoints_in_order(dir)) {
    if (!c.manifest) {
      rows.push_back({c.tag, "unreadable: " + c.error});
      continue;
    }
    const auto& m = *c.manifest;
    std::uint64_t bytes = 0;
    for (const auto& f : m.files) bytes += f.bytes;
    const std::time_t t =
        std::chrono::system_clock::to_time_t(std::chrono::file_clock::to_sys(c.when));
    std::tm utc{};
    char saved[32] = "?";
    if (gmtime_r(&t, &utc)) std::strftime(saved, sizeof saved, "%Y-%m-%d %H:%M:%S UTC", &utc);
    char text[160];
    std::snprintf(text, sizeof text, "step %-6lld %4d ranks  stage %d  %-4s  %9s  %s",
                  static_cast<long long>(m.step), m.world_size, m.stage, zp::name(m.dtype),
                  size_text(bytes).c_str(), saved);
    rows.push_back({c.tag, text});
  }
  std::size_t width = 3;
  for (const auto& r : rows) width = std::max(width, r.tag.size());
  std::printf("%zu checkpoint%s in %s\n", rows.size(), rows.size() == 1 ? "" : "s", dir.c_str());
  for (const auto& r : rows)
    std::printf("  %-*s  %s%s\n", int(width), r.tag.c_str(), r.text.c_str(),
                r.tag == latest ? "  (latest)" : "");
  std::vector<std::string> left;
  for (fs::directory_iterator end; !ec && it != end; it.increment(ec))
    if (const auto name = it->path().filename().string();
        zp::ckpt::DirectoryWriter::unfinished(name))
      left.push_back(name);
  std::sort(left.begin(), left.end());
  for (const auto& name : left)
    std::printf(
        "  %s: left by a save that did not finish, or one running now (the next save "
        "or prune removes it)\n",
        shown(name).c_str());
  return 0;
}

// Takes the directory as its writer (failing while a save runs), which removes what crashed
// saves left, then keeps `keep` checkpoints as a save's retention does.
int prune(const std::filesystem::path& dir, std::size_t keep) {
  zp::ckpt::DirectoryWriter writer(dir);
  for (const auto& name : writer.cleaned())
    std::printf("removed %s (left by a save that did not finish)\n", (dir / shown(name)).c_str());
  const auto pruned = writer.prune(keep);
  for (const auto& tag : pruned.removed) std::printf("removed %s\n", (dir / tag).c_str());
  for (const auto& why : pruned.failed) std::fprintf(stderr, "zp_ckpt: prune: %s\n", why.c_str());
  std::printf("pruned %s: %zu checkpoint%s removed\n", dir.c_str(), pruned.removed.size(),
              pruned.removed.size() == 1 ? "" : "s");
  return pruned.failed.empty() ? 0 : 1;
}

int verify(zp::ckpt::Reader& rd) {
  int bad_files = 0;
  std::uint64_t read = 0, total = 0;
  for (const auto& f : rd.manifest().files) total += f.bytes;
  auto progress = progress_lines("verify", "read");
  for (int r = 0; r < int(rd.manifest().files.size()); ++r) {
    const std::string why = rd.verify_file(r, [&](std::uint64_t n) { progress(read += n, total); });
    if (why.empty())
      std::printf("ok      %s\n", rd.file_path(r).c_str());
    else
      std::printf("FAILED  %s\n", why.c_str()), ++bad_files;
  }
  if (bad_files)
    std::fprintf(stderr, "zp_ckpt: %d of %zu files failed verification\n", bad_files,
                 rd.manifest().files.size());
  return bad_files ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
  if (argc < 2) bad("no command");
  const std::string cmd = argv[1];
  const auto* command = std::find_if(std::begin(commands), std::end(commands),
                                     [&](const Command& c) { return c.name == cmd; });
  if (command == std::end(commands)) bad("unknown command '" + cmd + "'");
  std::vector<std::string> pos, given;
  std::string tag = "latest", out_tag;
  int ranks = 0;
  std::size_t keep = 0;
  zp::ExportOptions eo;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (!a.starts_with("--")) {
      pos.push_back(a);
      continue;
    }
    if (!takes(*command, a))
      bad(std::none_of(std::begin(commands), std::end(commands),
                       [&](const Command& c) { return takes(c, a); })
              ? "unknown flag '" + a + "'"
              : cmd + " does not take " + a);
    if (std::find(given.begin(), given.end(), a) != given.end()) bad(a + " is given twice");
    given.push_back(a);
    auto value = [&] {
      if (i + 1 >= argc) bad(a + " needs a value");
      const std::string v = argv[++i];
      if (v.empty() || v.starts_with("--"))
        bad(a + " expects a value, got " + (v.empty() ? "an empty one" : "the flag '" + v + "'"));
      return v;
    };
    if (a == "--tag")
      tag = value();
    else if (a == "--out-tag")
      out_tag = value();
    else if (a == "--ranks")
      ranks = int(to_number(a, value(), 1, zp::ckpt::max_ranks));
    else if (a == "--keep")
      keep = std::size_t(to_number(a, value(), 1, std::numeric_limits<int>::max()));
    else if (a == "--master")
      eo.master = true;
    else  // --max-file-bytes
      eo.max_file_bytes =
          std::uint64_t(to_number(a, value(), 1, std::numeric_limits<long long>::max()));
  }
  if (pos.empty()) bad("no checkpoint directory");
  try {
    if (cmd == "list" || cmd == "prune") {
      if (pos.size() != 1) bad(cmd + " takes one directory");
      if (cmd == "list") return list(pos[0]);
      if (keep < 1) bad("prune takes DIR and --keep N");
      return prune(pos[0], keep);
    }
    if (cmd == "info" || cmd == "verify") {
      if (pos.size() != 1) bad(cmd + " takes one directory");
      zp::ckpt::Reader rd(pos[0], tag);
      return cmd == "info" ? info(rd) : verify(rd);
    }
    if (cmd == "export") {
      if (pos.size() != 2) bad("export takes DIR OUT");
      if (zp::detail::is_within(pos[1], pos[0]))  // (a tag's name, or into a checkpoint)
        bad("export's OUT " + pos[1] + " is inside DIR " + pos[0] +
            ", whose entries are checkpoints; export elsewhere");
      zp::ckpt::Reader rd(pos[0], tag);
      if (verify(rd)) return 1;
      eo.progress = progress_lines("export");
      zp::export_safetensors(rd, pos[1], eo);
      std::printf("exported %s to %s\n", rd.path().c_str(), pos[1].c_str());
      return 0;
    }
    if (cmd == "reshard") {
      if (pos.size() != 1 || ranks < 1) bad("reshard takes DIR and --ranks M");
      zp::ckpt::Reader rd(pos[0], tag);
      if (verify(rd)) return 1;
      if (out_tag.empty()) out_tag = rd.manifest().tag + "-" + std::to_string(ranks) + "ranks";
      const bool latest = zp::ckpt::reshard(rd, pos[0], out_tag, ranks, progress_lines("reshard"));
      std::printf("resharded %s for %d ranks as %s/%s (%s)\n", rd.path().c_str(), ranks,
                  pos[0].c_str(), out_tag.c_str(),
                  latest ? "now latest" : "latest names another checkpoint and stays");
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zp_ckpt: %s\n", e.what());
    return 1;
  }
}
