// tests/no_io_uring.cpp: runs a command where io_uring cannot move its bytes, in one of two ways
// (a seccomp filter, kept across exec):
//   no_io_uring COMMAND [ARG ...]             refused, as Docker's and containerd's default
//                                             seccomp profiles refuse it: io_uring_setup,
//                                             io_uring_enter and io_uring_register fail with EPERM
//   no_io_uring --before-5.6 COMMAND [ARG ...]  a kernel before Linux 5.6 (Ubuntu 20.04's 5.4):
//                                             rings are made, but io_uring_register knows no
//                                             IORING_REGISTER_PROBE (EINVAL), so no operation
//                                             can be listed as supported
// Checks that the filter holds before it runs the command, so a test run under it cannot pass on
// io_uring by mistake, and tells the command which it is (ZP_TEST_IO_URING_REFUSAL = eperm or
// before-5.6); where no filter can be installed, exits 77 (skipped) saying so.
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  const bool before_5_6 = argc > 1 && std::strcmp(argv[1], "--before-5.6") == 0;
  char** command = argv + 1 + before_5_6;
  if (!*command) {
    std::fprintf(stderr, "usage: no_io_uring [--before-5.6] COMMAND [ARG ...]\n");
    return 2;
  }
  static_assert(__NR_io_uring_setup + 2 == __NR_io_uring_register, "the three are consecutive");
  // The calls from `first` to __NR_io_uring_register fail with `err`, the others run.
  const unsigned first = before_5_6 ? __NR_io_uring_register : __NR_io_uring_setup;
  const unsigned err = before_5_6 ? EINVAL : EPERM;
  sock_filter code[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, first, 0, 2),                   // below: allowed
      BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, __NR_io_uring_register, 1, 0),  // above: allowed
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | err),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  const sock_fprog prog{sizeof(code) / sizeof(code[0]), code};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
      ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    std::fprintf(stderr, "no_io_uring: skipped: cannot install a seccomp filter here: %s\n",
                 std::strerror(errno));
    return 77;  // ctest's SKIP_RETURN_CODE for these tests
  }
  // Each call must fail before it reads its arguments: no ring is made, none is registered to.
  char params[120] = {};  // struct io_uring_params
  const bool holds = before_5_6 ? ::syscall(__NR_io_uring_register, -1, 8, nullptr, 0) == -1 &&
                                      errno == EINVAL  // (a real kernel: EBADF for fd -1)
                                : ::syscall(__NR_io_uring_setup, 1, params) == -1 && errno == EPERM;
  if (!holds) {
    std::fprintf(stderr, "no_io_uring: the filter does not hold\n");
    return 1;
  }
  ::setenv("ZP_TEST_IO_URING_REFUSAL", before_5_6 ? "before-5.6" : "eperm", 1);
  ::execvp(command[0], command);
  std::fprintf(stderr, "no_io_uring: cannot run %s: %s\n", command[0], std::strerror(errno));
  return 1;
}
