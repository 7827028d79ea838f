#include "text_corpus.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include <fmt/core.h>

#include "zest/error.hpp"

namespace zest::charlm {
namespace {

// Closes the descriptor on every path out of read_file, exceptions included.
struct FileDescriptor {
  int fd;
  ~FileDescriptor() { ::close(fd); }
};

std::string read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd == -1) {
    throw IoError("cannot open the text corpus (set the path of an existing, readable text file)",
                  path, 0, 0, errno);
  }
  FileDescriptor guard{fd};
  std::string text;
  char chunk[1 << 16];
  for (;;) {
    const ssize_t got = ::read(fd, chunk, sizeof chunk);
    if (got == 0) break;
    if (got == -1) {
      if (errno == EINTR) continue;
      throw IoError("cannot read the text corpus (is it a regular, readable file?)", path,
                    text.size(), sizeof chunk, errno);
    }
    text.append(chunk, static_cast<std::size_t>(got));
  }
  return text;
}

}  // namespace

TextCorpus TextCorpus::load(const std::string& path) {
  return from_text(read_file(path), path);
}

TextCorpus TextCorpus::from_text(std::string_view text, std::string origin) {
  if (text.empty()) {
    std::string message = "the text corpus ";
    message.append(origin).append(" is empty: a language model needs text to train on; "
                                  "point it at a non-empty text file");
    throw Error(message);
  }
  TextCorpus corpus;
  corpus.origin_ = std::move(origin);
  std::array<bool, 256> present{};
  for (const char c : text) present[static_cast<unsigned char>(c)] = true;
  corpus.id_of_byte_.fill(-1);
  for (std::size_t byte = 0; byte < present.size(); ++byte) {
    if (!present[byte]) continue;
    corpus.id_of_byte_[byte] = static_cast<Token>(corpus.vocabulary_.size());
    corpus.vocabulary_.push_back(static_cast<unsigned char>(byte));
  }
  corpus.tokens_.reserve(text.size());
  for (const char c : text) corpus.tokens_.push_back(corpus.id_of_byte_[static_cast<unsigned char>(c)]);
  return corpus;
}

std::string TextCorpus::decode(std::span<const Token> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (const Token id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= vocabulary_.size()) {
      throw Error(
          fmt::format("token id {} is outside the vocabulary of {} ({} symbols)", id, origin_, vocabulary_.size()));
    }
    text.push_back(static_cast<char>(vocabulary_[static_cast<std::size_t>(id)]));
  }
  return text;
}

}  // namespace zest::charlm
