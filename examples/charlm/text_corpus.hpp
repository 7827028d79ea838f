// A text file as a sequence of token ids over its own byte vocabulary: the sorted distinct bytes
// of the file, so token id i stands for the i-th smallest byte that occurs in it.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace zest::charlm {

using Token = std::int32_t;

// Ships with every Debian system (package base-files), so the example needs no download.
inline constexpr const char* kDefaultCorpusPath = "/usr/share/common-licenses/GPL-3";

class TextCorpus {
 public:
  // Reads the whole file. Throws zest::IoError (path and errno) when it cannot be opened or read,
  // and zest::Error naming the path when it is empty.
  static TextCorpus load(const std::string& path = kDefaultCorpusPath);
  // The same from text already in memory; `origin` names it in error messages.
  static TextCorpus from_text(std::string_view text, std::string origin = "<memory>");

  const std::string& origin() const { return origin_; }
  std::size_t vocab_size() const { return vocabulary_.size(); }
  // id -> byte, sorted ascending.
  const std::vector<unsigned char>& vocabulary() const { return vocabulary_; }
  std::span<const Token> tokens() const { return tokens_; }

  // The id of a byte, or -1 when the byte does not occur in the text.
  Token id_of(unsigned char byte) const { return id_of_byte_[byte]; }
  // Throws zest::Error for an id outside [0, vocab_size()).
  std::string decode(std::span<const Token> ids) const;

 private:
  std::string origin_;
  std::vector<unsigned char> vocabulary_;
  std::array<Token, 256> id_of_byte_{};
  std::vector<Token> tokens_;
};

}  // namespace zest::charlm
