// The aio component: a file written and read back through io_uring.
#include <zp/async_file.hpp>

#include <cstdio>
#include <cstring>

int main() {
  zp::aio::AlignedBuffer out(3 * zp::aio::alignment), in(3 * zp::aio::alignment);
  for (std::size_t i = 0; i < out.span().size(); ++i) out.span()[i] = std::byte(i * 7 + 1);
  {
    zp::aio::File f("consumer_aio.bin", zp::aio::Mode::read_write);
    f.write(out.span(), 0);
    f.read(in.span(), 0);
  }
  std::remove("consumer_aio.bin");
  const bool ok = std::memcmp(in.span().data(), out.span().data(), out.span().size()) == 0;
  std::printf("consumer: aio round trip %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
