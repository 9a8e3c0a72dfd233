# Install the headers and an export set; zpConfig.cmake finds only the dependencies of the
# components that were built (and asked for).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/zp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
set(_zp_targets zp)
foreach(_c sim mpi io cuda nccl)
  if(TARGET zp_${_c})
    list(APPEND _zp_targets zp_${_c})
  endif()
endforeach()
install(TARGETS ${_zp_targets} EXPORT zpTargets)
install(EXPORT zpTargets NAMESPACE zp:: DESTINATION ${CMAKE_INSTALL_DATADIR}/zp/cmake)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/zpConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/zpConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_DATADIR}/zp/cmake)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/zpConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/zpConfig.cmake ${PROJECT_BINARY_DIR}/zpConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake
        DESTINATION ${CMAKE_INSTALL_DATADIR}/zp/cmake)
