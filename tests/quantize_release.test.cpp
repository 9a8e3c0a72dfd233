// quantize.test.cpp built as a release build compiles it (-O2, by the unsanitized preset's GCC;
// the sanitizer presets build it at -O0 and -O1 with Clang): the vector paths against the
// portable one as users' optimised builds run them. There GCC contracts a product and a
// following add of the intrinsics' vector operators into one fma (-ffp-contract=fast, its
// default), which unoptimised builds never show.
#include "quantize.test.cpp"
