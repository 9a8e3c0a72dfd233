// zp_ckpt: inspect, verify, export and reshard zp checkpoints offline (no GPU, no MPI, one
// process; memory: one parameter chunk or rank slice at a time, never the model).
//
//   zp_ckpt info    DIR [--tag T]
//   zp_ckpt verify  DIR [--tag T]
//   zp_ckpt export  DIR OUT [--tag T] [--master] [--max-file-bytes N]
//   zp_ckpt reshard DIR --ranks M [--tag T] [--out-tag T2]
//
// Exit status: 0 success (and --help), 1 a failed check or I/O error (the message names the
// file), 2 usage (an unknown command or flag, a flag the command does not take or given twice).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "zp/checkpoint_format.hpp"

namespace {

const char* usage =
    "usage: zp_ckpt info    DIR [--tag T]\n"
    "       zp_ckpt verify  DIR [--tag T]\n"
    "       zp_ckpt export  DIR OUT [--tag T] [--master] [--max-file-bytes N]\n"
    "       zp_ckpt reshard DIR --ranks M [--tag T] [--out-tag T2]\n"
    "  DIR      a checkpoint directory (the one holding `latest`)\n"
    "  --tag    which checkpoint (default: the one `latest` names)\n"
    "  export   writes OUT/model.safetensors (T parameters; --master: fp32 master weights), split\n"
    "           into model-0000k-of-n files with an index above --max-file-bytes\n"
    "  reshard  writes DIR/<out-tag> (default <tag>-<M>ranks) laid out for M ranks\n";

// The commands and the options each takes.
struct Command {
  std::string_view name;
  std::vector<std::string_view> options;
};
const Command commands[] = {{"info", {"--tag"}},
                            {"verify", {"--tag"}},
                            {"export", {"--tag", "--master", "--max-file-bytes"}},
                            {"reshard", {"--tag", "--ranks", "--out-tag"}}};

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
      m.optimizer.c_str(), m.hyper.dump().c_str());
  std::printf("  %zu parameters, %zu elements in %d modules; fields:", m.params.size(), elements,
              m.params.back().module + 1);
  for (const auto& f : m.fields) std::printf(" %s", f.c_str());
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

// A long export or reshard says where it is: a line on stderr every 5 s (one of a few GB ends
// before the first).
zp::ckpt::Progress progress_lines(const char* what) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  return [what, start, next = start + std::chrono::seconds(5)](std::uint64_t done,
                                                               std::uint64_t total) mutable {
    const auto now = clock::now();
    if (now < next) return;
    next = now + std::chrono::seconds(5);
    const double secs = std::chrono::duration<double>(now - start).count();
    std::fprintf(stderr, "zp_ckpt: %s: %.2f of %.2f GB written (%.0f%%), %.0f MB/s\n", what,
                 double(done) / 1e9, double(total) / 1e9,
                 total ? 100.0 * double(done) / double(total) : 100.0, double(done) / 1e6 / secs);
  };
}

int verify(zp::ckpt::Reader& rd) {
  int bad_files = 0;
  for (int r = 0; r < int(rd.manifest().files.size()); ++r) {
    const std::string why = rd.verify_file(r);
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
    else if (a == "--master")
      eo.master = true;
    else  // --max-file-bytes
      eo.max_file_bytes =
          std::uint64_t(to_number(a, value(), 1, std::numeric_limits<long long>::max()));
  }
  if (pos.empty()) bad("no checkpoint directory");
  try {
    if (cmd == "info" || cmd == "verify") {
      if (pos.size() != 1) bad(cmd + " takes one directory");
      zp::ckpt::Reader rd(pos[0], tag);
      return cmd == "info" ? info(rd) : verify(rd);
    }
    if (cmd == "export") {
      if (pos.size() != 2) bad("export takes DIR OUT");
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
                  latest ? "now latest" : "latest names a newer checkpoint and stays");
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zp_ckpt: %s\n", e.what());
    return 1;
  }
}
