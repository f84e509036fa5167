// The native path's errors: which Python exception each becomes (native_setup.py's make_error
// turns a kind into the class the Python path raises: PeerFailure, CollectiveMismatchError,
// ShmArgumentError).

#pragma once

#include <stdexcept>
#include <string>

namespace shm_native {

// Which Python exception a native error becomes (the classes the Python path raises).
enum class ErrorKind { Peer, Mismatch, Argument, Disagree };  // Disagree: a mismatch described in its text

struct NativeError : std::runtime_error {
  NativeError(ErrorKind k, const std::string& text) : std::runtime_error(text), kind(k) {}
  ErrorKind kind;
};

}  // namespace shm_native
