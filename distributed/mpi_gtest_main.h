// gtest main for tests that run under mpirun: one MPI communicator for the whole process (g_comm), and a test
// failure on any rank fails every rank.
#pragma once

#include "base/communicator.h"

namespace sg::dist {
extern Communicator* g_comm;  // set before the tests run
}  // namespace sg::dist
