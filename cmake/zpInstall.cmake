# zp's export set, its build-tree package and its install rules (component zp).
# The export set zpTargets always holds zp's targets, so a project that takes zp by
# add_subdirectory or FetchContent can install and export its own targets that link zp::zp.
# export() writes zpTargets.cmake next to zpConfig.cmake in the build tree: find_package(zp) with
# zp_DIR=<zp's build dir> uses the build tree directly. The install rules are part of
# `cmake --install` when ZP_INSTALL is ON (a top-level zp); otherwise they are left out of the
# parent's install, and `cmake --install <build> --component zp` still installs zp.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(_zp_install_args COMPONENT zp)
if(NOT ZP_INSTALL)
  list(APPEND _zp_install_args EXCLUDE_FROM_ALL)
endif()
set(_zp_cmake_dir ${CMAKE_INSTALL_DATADIR}/zp/cmake)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/zp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        ${_zp_install_args})
set(_zp_targets zp)
foreach(_c sim mpi io aio cuda nccl)
  if(TARGET zp_${_c})
    list(APPEND _zp_targets zp_${_c})
  endif()
endforeach()
install(TARGETS ${_zp_targets} EXPORT zpTargets ${_zp_install_args})
install(EXPORT zpTargets NAMESPACE zp:: DESTINATION ${_zp_cmake_dir} ${_zp_install_args})
export(EXPORT zpTargets NAMESPACE zp:: FILE ${PROJECT_BINARY_DIR}/zpTargets.cmake)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/zpConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/zpConfig.cmake
                              INSTALL_DESTINATION ${_zp_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/zpConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
foreach(_f FindNCCL FindLiburing)  # zpConfig.cmake looks for them beside itself, in the build tree too
  configure_file(${PROJECT_SOURCE_DIR}/cmake/${_f}.cmake ${PROJECT_BINARY_DIR}/${_f}.cmake COPYONLY)
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/zpConfig.cmake ${PROJECT_BINARY_DIR}/zpConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake ${PROJECT_SOURCE_DIR}/cmake/FindLiburing.cmake
        DESTINATION ${_zp_cmake_dir} ${_zp_install_args})
