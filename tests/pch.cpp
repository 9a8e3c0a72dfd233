// The translation unit that compiles tests/pch.hpp once for the test programs that reuse it.
