#include "examples/charlm/text_corpus.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "zest/error.hpp"

namespace zest::charlm {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(TextCorpus, LoadsDebianGplAndRoundTripsEveryByte) {
  const std::string expected = slurp(kDefaultCorpusPath);
  ASSERT_FALSE(expected.empty()) << kDefaultCorpusPath << " ships with Debian's base-files";
  const TextCorpus corpus = TextCorpus::load();
  EXPECT_EQ(corpus.origin(), kDefaultCorpusPath);
  EXPECT_EQ(corpus.tokens().size(), expected.size());
  EXPECT_EQ(corpus.decode(corpus.tokens()), expected);

  const std::set<unsigned char> distinct(expected.begin(), expected.end());
  const std::vector<unsigned char> sorted(distinct.begin(), distinct.end());
  EXPECT_EQ(corpus.vocabulary(), sorted);
  for (std::size_t id = 0; id < sorted.size(); ++id) {
    EXPECT_EQ(corpus.id_of(sorted[id]), static_cast<Token>(id));
  }
  EXPECT_EQ(corpus.id_of(0), -1) << "the GPL text holds no NUL byte";
}

TEST(TextCorpus, VocabularyIsSortedDistinctBytes) {
  const TextCorpus corpus = TextCorpus::from_text("banana");
  EXPECT_EQ(corpus.vocabulary(), (std::vector<unsigned char>{'a', 'b', 'n'}));
  const std::vector<Token> expected{1, 0, 2, 0, 2, 0};
  EXPECT_EQ(std::vector<Token>(corpus.tokens().begin(), corpus.tokens().end()), expected);
  EXPECT_EQ(corpus.id_of('z'), -1);
}

TEST(TextCorpus, HighBytesAreTokensToo) {
  const std::string text{"\xff\x00\x80\x00", 4};
  const TextCorpus corpus = TextCorpus::from_text(text);
  EXPECT_EQ(corpus.vocabulary(), (std::vector<unsigned char>{0x00, 0x80, 0xff}));
  EXPECT_EQ(corpus.decode(corpus.tokens()), text);
}

TEST(TextCorpus, MissingFileNamesPathAndErrno) {
  const std::string path = "/nonexistent/zest/corpus.txt";
  try {
    (void)TextCorpus::load(path);
    FAIL() << "expected IoError";
  } catch (const IoError& error) {
    EXPECT_EQ(error.path(), path);
    EXPECT_EQ(error.error_number(), ENOENT);
    const std::string message = error.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("No such file or directory"), std::string::npos) << message;
    EXPECT_NE(message.find("cannot open the text corpus"), std::string::npos) << message;
  }
}

TEST(TextCorpus, DirectoryIsUnreadable) {
  try {
    (void)TextCorpus::load("/tmp");
    FAIL() << "expected IoError";
  } catch (const IoError& error) {
    EXPECT_EQ(error.error_number(), EISDIR);
    EXPECT_NE(std::string(error.what()).find("/tmp"), std::string::npos) << error.what();
  }
}

TEST(TextCorpus, EmptyFileIsAnError) {
  char path[] = "/tmp/zest_empty_corpus_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_NE(fd, -1);
  close(fd);
  try {
    (void)TextCorpus::load(path);
    unlink(path);
    FAIL() << "expected Error";
  } catch (const Error& error) {
    unlink(path);
    const std::string message = error.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find("empty"), std::string::npos) << message;
  }
}

TEST(TextCorpus, DecodeRejectsIdsOutsideVocabulary) {
  const TextCorpus corpus = TextCorpus::from_text("abc", "inline");
  const std::vector<Token> bad{0, 3};
  try {
    (void)corpus.decode(bad);
    FAIL() << "expected Error";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("token id 3"), std::string::npos) << message;
    EXPECT_NE(message.find("3 symbols"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace zest::charlm
