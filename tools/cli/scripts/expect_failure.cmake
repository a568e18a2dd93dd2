# Runs a command and passes only if it exits with EXPECT_CODE and its stderr matches
# EXPECT_REGEX (so a crash or a silent failure does not count as the expected error).
#   cmake -DPROGRAM=exe -DARGS="a|b|c" -DEXPECT_CODE=1 -DEXPECT_REGEX=regex -P expect_failure.cmake
string(REPLACE "|" ";" arguments "${ARGS}")
execute_process(COMMAND ${PROGRAM} ${arguments}
                RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "exit ${code}; stderr: ${err}")
if(NOT "${code}" STREQUAL "${EXPECT_CODE}")
  message(FATAL_ERROR "expected exit code ${EXPECT_CODE}, got ${code}")
endif()
if(NOT err MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "stderr does not match \"${EXPECT_REGEX}\"")
endif()
