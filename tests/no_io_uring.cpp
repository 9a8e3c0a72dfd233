// tests/no_io_uring.cpp: runs a command with io_uring refused, as Docker's and containerd's
// default seccomp profiles refuse it: io_uring_setup, io_uring_enter and io_uring_register fail
// with EPERM (a seccomp filter, kept across exec). Checks that the refusal holds before it runs
// the command, so a test run under it cannot pass on io_uring by mistake; where no filter can be
// installed, exits 77 (skipped) saying so.
//   no_io_uring COMMAND [ARG ...]
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: no_io_uring COMMAND [ARG ...]\n");
    return 2;
  }
  static_assert(__NR_io_uring_setup + 2 == __NR_io_uring_register, "the three are consecutive");
  sock_filter code[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, __NR_io_uring_setup, 0, 2),     // below: allowed
      BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, __NR_io_uring_register, 1, 0),  // above: allowed
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  const sock_fprog prog{sizeof(code) / sizeof(code[0]), code};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
      ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    std::fprintf(stderr, "no_io_uring: skipped: cannot install a seccomp filter here: %s\n",
                 std::strerror(errno));
    return 77;  // ctest's SKIP_RETURN_CODE for these tests
  }
  char params[120] = {};  // struct io_uring_params; the call must fail before reading it
  if (::syscall(__NR_io_uring_setup, 1, params) != -1 || errno != EPERM) {
    std::fprintf(stderr, "no_io_uring: io_uring_setup is not refused with EPERM\n");
    return 1;
  }
  ::execvp(argv[1], argv + 1);
  std::fprintf(stderr, "no_io_uring: cannot run %s: %s\n", argv[1], std::strerror(errno));
  return 1;
}
