# FindLiburing: liburing's header and library (Debian's liburing-dev), under LIBURING_ROOT or the
# system's paths. Defines Liburing::Liburing and Liburing_FOUND.
find_path(LIBURING_INCLUDE_DIR liburing.h HINTS ${LIBURING_ROOT} $ENV{LIBURING_ROOT}
          PATH_SUFFIXES include)
find_library(LIBURING_LIBRARY NAMES uring HINTS ${LIBURING_ROOT} $ENV{LIBURING_ROOT}
             PATH_SUFFIXES lib lib64)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Liburing REQUIRED_VARS LIBURING_LIBRARY LIBURING_INCLUDE_DIR)
if(Liburing_FOUND AND NOT TARGET Liburing::Liburing)
  add_library(Liburing::Liburing UNKNOWN IMPORTED)
  set_target_properties(Liburing::Liburing PROPERTIES IMPORTED_LOCATION "${LIBURING_LIBRARY}"
                                                      INTERFACE_INCLUDE_DIRECTORIES
                                                      "${LIBURING_INCLUDE_DIR}")
endif()
mark_as_advanced(LIBURING_INCLUDE_DIR LIBURING_LIBRARY)
