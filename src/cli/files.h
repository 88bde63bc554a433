// Files the command line reads and writes, with the system's reason in every error, and outputs
// written under a temporary name so that a failure or an interrupt never leaves a partial file.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <string>

namespace mb::cli {

// The whole file, or all of stdin for "-". `what` names it in errors ("prompt file").
std::string read_file(const std::string& path, const char* what);

// Creates or truncates `path` and writes n bytes.
void write_file(const std::string& path, const void* data, size_t n);

// Refuses an output that would overwrite the input `in` (also through another spelling of the
// same path, or a link), whose temporary OUT.part would, or that is a directory. `cmd` names the
// subcommand in messages.
void check_output_path(const std::string& in, const std::string& out, const char* cmd);

// An output written to OUT.part and renamed to OUT by commit(). Until then OUT.part is removed
// when this object goes away (an error) and when SIGINT, SIGTERM or SIGHUP ends the process
// (Ctrl-C); a child process that writes it is ended with SIGTERM when this process dies. One at a
// time.
class PartialOutput {
 public:
  explicit PartialOutput(std::string out);
  ~PartialOutput();
  PartialOutput(const PartialOutput&) = delete;
  PartialOutput& operator=(const PartialOutput&) = delete;

  const std::string& temp_path() const { return temp_; }
  void commit();
  // In a child process that writes temp_path(): end it with SIGTERM (which removes the file)
  // when its parent, `parent`, dies.
  static void die_with_parent(pid_t parent);

 private:
  std::string out_, temp_;
  bool committed_ = false;
};

}  // namespace mb::cli
