// Releasing the GIL from a native op that blocks on other processes (a collective), as
// torch.distributed's own calls do: while one rank waits, the process's other Python threads
// (the step watchdog, health checks, the gRPC server) keep running.
#pragma once

#include <Python.h>

namespace kvmesh_cpu {

class GilRelease {
 public:
  GilRelease() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilRelease() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace kvmesh_cpu
