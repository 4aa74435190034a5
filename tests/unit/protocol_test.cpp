#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "protocol_canonical.h"
#include "varuna/common/protocol.h"

using namespace varuna::proto;

namespace {

std::vector<Message> samples() {
  LaunchWorkers launch;
  launch.workers = {{0, 0}, {1, 1}};
  launch.argv = {"/bin/train", "--steps", "10"};
  launch.codeDir = "/code";
  launch.env = {{"A", "1"}, {"B", "x y"}};
  launch.stageToRankMap = "0,2;1,3;";
  launch.chunkSize = 4;
  launch.batchSize = 16;
  launch.resumeStep = 40;
  launch.masterAddr = "10.0.0.4";
  launch.masterPort = 29500;
  launch.worldSize = 4;
  return {Hello{kVersion, "secret", "worker", "10.0.0.4", 3, 2},
          Hello{kVersion, "vj1.2000000000.ab", "join", "node-7", -1, -1, 8},
          Joined{"1b6c", {{"NCCL_DEBUG", "WARN"}, {"EMPTY", ""}}},
          Joined{"1b6c", {}, 5000, 15000, 500},
          Heartbeat{2, 17},
          StepReport{1, 1, 0, 9, 2.5, 0.25, 0.0125},
          WorkerExited{"10.0.0.5", 3, -1, 9, 4},
          PreemptNotice{"10.0.0.5", 1790000000000},
          launch,
          CheckpointAndExit{},
          KillWorkers{"morph"},
          Shutdown{"host preempted"},
          Ping{7, 123456789},
          Pong{7, 123456789},
          Ack{false, "no such host"},
          CheckpointFailed{2, 40, "writing varuna_ckpt_40/piece_3_head.params.pt: No space left on device"},
          Welcome{5, 15000, 30000},
          ExitNow{5, "rank 1 exited with code 3 (lost a peer)"},
          SalvageStop{5, "host 10.0.0.5 was lost"},
          SalvageReady{3, 1, 1, 41, 5},
          SalvageReady{3, 1, 1, 41, 5, 42, {}},
          SalvageReady{2, 0, 1, 42, 5, -1, {12.25, 0.1 + 0.2, 1.0}},
          SalvageReady{2, 0, 1, -1, 5, -1, {12.25, 0.5, 0.0}, 43},  // a result of the step after none it holds
          SalvageWrite{5, 41, 1, 2},
          SalvageWrite{5, 42, 1, 2, {12.25, 0.1 + 0.2, 0.0}},
          WorkerBeats{5, {{0, 12, false}, {3, -1, true}}},
          WorkerBeats{6, {}}};
}

}  // namespace

TEST_CASE("every message survives encode and decode", "[protocol]") {
  for (const auto& m : samples()) {
    INFO(typeName(m));
    FrameDecoder decoder;
    decoder.feed(encode(m));
    auto back = decoder.next();
    REQUIRE(back.has_value());
    CHECK(*back == m);
    CHECK(decoder.buffered() == 0);
  }
}

TEST_CASE("hello: a hello without slots (every role but join) decodes with 0", "[protocol]") {
  const auto m = decodeBody(R"({"type":"hello","version":2,"token":"t","role":"agent","host":"h","rank":-1,"generation":-1})");
  CHECK(std::get<Hello>(m).slots == 0);
  CHECK_THROWS_AS(decodeBody(R"({"type":"joined","credential":"c","env":[["A"]]})"), ProtocolError);
}

TEST_CASE("frames split anywhere and glued together decode in order", "[protocol]") {
  std::string stream;
  for (const auto& m : samples()) stream += encode(m);
  FrameDecoder decoder;
  std::vector<Message> got;
  for (char c : stream) {  // one byte at a time: the worst fragmentation
    decoder.feed(std::string_view(&c, 1));
    while (auto m = decoder.next()) got.push_back(*m);
  }
  CHECK(got == samples());
}

TEST_CASE("truncated, oversized and malformed frames", "[protocol]") {
  const std::string frame = encode(Heartbeat{1, 2});
  FrameDecoder truncated;
  truncated.feed(frame.substr(0, frame.size() - 1));
  CHECK_FALSE(truncated.next().has_value());  // waits for the rest

  FrameDecoder oversized(64);
  oversized.feed(std::string("\x00\x10\x00\x00", 4));  // claims 1 MiB before any body arrives
  CHECK_THROWS_WITH(oversized.next(), Catch::Contains("exceeds the limit of 64"));

  FrameDecoder garbage;
  garbage.feed(std::string("\x00\x00\x00\x05", 4) + "{nope");
  CHECK_THROWS_AS(garbage.next(), ProtocolError);

  const std::string body = R"({"type":"format_disk"})";
  FrameDecoder typed;
  typed.feed(std::string("\x00\x00\x00", 3) + static_cast<char>(body.size()) + body);
  CHECK_THROWS_WITH(typed.next(), Catch::Contains("unknown message type 'format_disk'"));

  const std::string missing = R"({"type":"heartbeat","rank":1})";
  CHECK_THROWS_WITH(decodeBody(missing), Catch::Contains("malformed message"));
}

TEST_CASE("the first frame must be a hello with our version and token", "[protocol]") {
  CHECK(checkHello(Hello{kVersion, "t0k", "agent", "h1", -1}, "t0k").role == "agent");
  CHECK_THROWS_WITH(checkHello(Hello{kVersion, "guess", "agent", "h1", -1}, "t0k"),
                    Catch::Contains("wrong job token from 'h1'") && !Catch::Contains("t0k"));
  CHECK_THROWS_WITH(checkHello(Hello{kVersion + 1, "t0k", "agent", "h1", -1}, "t0k"), Catch::Contains("protocol version"));
  CHECK_THROWS_WITH(checkHello(Heartbeat{}, "t0k"), Catch::Contains("first message must be hello"));
  // A refused peer's text is what the manager logs: bounded and valid UTF-8,
  // however long (up to a whole frame) or odd the peer's host field is.
  for (const auto& host : {std::string(kMaxFrameBytes - 200, 'h'), std::string(5000, '\xff')}) {
    for (const uint32_t version : {kVersion, kVersion + 1}) {
      try {
        checkHello(Hello{version, "guess", "worker", host, 0, 1}, "t0k");
        FAIL("accepted");
      } catch (const ProtocolError& e) {
        const std::string what = e.what();
        CHECK(what.size() < kMaxLoggedPeerTextBytes + 100);
        CHECK(boundedText(what, what.size()) == what);  // valid UTF-8 already
      }
    }
  }
}

TEST_CASE("exit_now and welcome: malformed bodies are refused, the reason is bounded", "[protocol]") {
  CHECK(decodeBody(R"({"type":"exit_now","generation":3,"reason":"kill-all"})") == Message(ExitNow{3, "kill-all"}));
  CHECK(decodeBody(R"({"type":"welcome","generation":3,"lost_manager_grace_ms":15000})") ==
        Message(Welcome{3, 15000}));  // an older manager's welcome: salvage off
  CHECK(decodeBody(R"({"type":"welcome","generation":3,"lost_manager_grace_ms":15000,"salvage_timeout_ms":9000})") ==
        Message(Welcome{3, 15000, 9000}));
  CHECK_THROWS_WITH(decodeBody(R"({"type":"salvage_ready","rank":1,"stage":0,"replica":1,"generation":2})"),
                    Catch::Contains("malformed message"));
  CHECK_THROWS_WITH(decodeBody(R"({"type":"salvage_write","generation":2,"step":"4","writer_index":0,"writers":2})"),
                    Catch::Contains("malformed message"));
  CHECK_THROWS_WITH(decodeBody(R"({"type":"exit_now","generation":3})"), Catch::Contains("malformed message"));
  CHECK_THROWS_WITH(decodeBody(R"({"type":"exit_now","generation":"3","reason":""})"), Catch::Contains("malformed message"));
  CHECK_THROWS_WITH(decodeBody(R"({"type":"welcome","generation":3})"), Catch::Contains("malformed message"));
  const auto cut = std::get<ExitNow>(decodeBody(encode(ExitNow{1, std::string(5000, 'r') + "\xff"}).substr(4)));
  CHECK(cut.reason.size() == kMaxErrorTextBytes);
  const std::string raw = R"({"type":"exit_now","generation":1,"reason":")" + std::string(100000, 'r') + "\"}";
  CHECK(std::get<ExitNow>(decodeBody(raw)).reason.size() == kMaxErrorTextBytes);
}

TEST_CASE("worker_beats: beats are [rank, step, waiting] triples; any other shape is refused", "[protocol]") {
  CHECK(decodeBody(R"({"type":"worker_beats","generation":2,"beats":[[0,5,false],[3,-1,true]]})") ==
        Message(WorkerBeats{2, {{0, 5, false}, {3, -1, true}}}));
  CHECK(decodeBody(R"({"type":"worker_beats","generation":2,"beats":[]})") == Message(WorkerBeats{2, {}}));
  for (const char* body : {R"({"type":"worker_beats","generation":2})",
                           R"({"type":"worker_beats","generation":2,"beats":null})",
                           R"({"type":"worker_beats","generation":2,"beats":{"a":[0,5,false]}})",
                           R"({"type":"worker_beats","generation":2,"beats":[[0,5]]})",
                           R"({"type":"worker_beats","generation":2,"beats":[[0,5,false,1]]})",
                           R"({"type":"worker_beats","generation":2,"beats":[{"rank":0}]})",
                           R"({"type":"worker_beats","generation":2,"beats":[["0",5,false]]})",
                           R"({"type":"worker_beats","generation":2,"beats":[[0,5,"no"]]})"}) {
    INFO(body);
    CHECK_THROWS_AS(decodeBody(body), ProtocolError);
  }
}

TEST_CASE("worker_beats: relayed step reports are 7-tuples, non-finite figures as null; other shapes refused",
          "[protocol]") {
  const StepReport fine{3, 1, 0, 42, 2.5, 0.125, 0.01};
  const StepReport overflowed{2, 0, 1, 43, std::nan(""), std::numeric_limits<double>::infinity(), 0.02};
  const auto back = std::get<WorkerBeats>(decodeBody(encode(WorkerBeats{5, {{3, 42, false}}, {fine, overflowed}}).substr(4)));
  CHECK(back.generation == 5);
  CHECK(back.beats == std::vector<WorkerBeat>{{3, 42, false}});
  REQUIRE(back.reports.size() == 2);
  CHECK(back.reports[0] == fine);
  CHECK(back.reports[1].rank == 2);
  CHECK(back.reports[1].step == 43);
  CHECK(std::isnan(back.reports[1].loss));
  CHECK(std::isnan(back.reports[1].stepSeconds));  // inf travels as null, like NaN
  // An agent from before relayed reports sends none: the field may be absent.
  CHECK(std::get<WorkerBeats>(decodeBody(R"({"type":"worker_beats","generation":2,"beats":[]})")).reports.empty());
  for (const char* body : {R"({"type":"worker_beats","generation":2,"beats":[],"reports":[[1,0,0,4,2.5,0.1]]})",
                           R"({"type":"worker_beats","generation":2,"beats":[],"reports":[{"rank":1}]})",
                           R"({"type":"worker_beats","generation":2,"beats":[],"reports":[["1",0,0,4,2.5,0.1,0.0]]})",
                           R"({"type":"worker_beats","generation":2,"beats":[],"reports":{"a":1}})"}) {
    INFO(body);
    CHECK_THROWS_AS(decodeBody(body), ProtocolError);
  }
}

TEST_CASE("salvage: the exchange result travels bit for bit; non-finite as null; any other shape is refused",
          "[protocol]") {
  const std::vector<double> exact = {1.0 / 3.0, 4.9406564584124654e-324, 1.7976931348623157e308};
  const auto back = std::get<SalvageWrite>(decodeBody(encode(SalvageWrite{2, 7, 0, 2, exact}).substr(4)));
  CHECK(back.exchange == exact);
  const std::vector<double> overflow = {std::nan(""), -std::numeric_limits<double>::infinity(), 0.0};
  const auto inf = std::get<SalvageReady>(decodeBody(encode(SalvageReady{1, 1, 0, 6, 2, -1, overflow}).substr(4)));
  REQUIRE(inf.exchange.size() == 3);
  CHECK((std::isinf(inf.exchange[0]) && std::isinf(inf.exchange[1]) && inf.exchange[2] == 0.0));
  // A version-2 worker that does not send the new fields: nothing finishable, no result.
  CHECK(decodeBody(R"({"type":"salvage_ready","rank":1,"stage":0,"replica":1,"step":4,"generation":2})") ==
        Message(SalvageReady{1, 0, 1, 4, 2}));
  for (const char* body : {R"({"type":"salvage_write","generation":2,"step":4,"writer_index":0,"writers":2,"exchange":[1,2]})",
                           R"({"type":"salvage_write","generation":2,"step":4,"writer_index":0,"writers":2,"exchange":3})",
                           R"({"type":"salvage_write","generation":2,"step":4,"writer_index":0,"writers":2,"exchange":[1,"2",3]})",
                           R"({"type":"salvage_ready","rank":1,"stage":0,"replica":1,"step":4,"generation":2,"exchange":[1,2,3,4]})",
                           R"({"type":"salvage_ready","rank":1,"stage":0,"replica":1,"step":4,"generation":2,"finishable_step":"5"})",
                           R"({"type":"salvage_ready","rank":1,"stage":0,"replica":1,"step":-1,"generation":2,"exchange_step":"5"})"}) {
    INFO(body);
    CHECK_THROWS_AS(decodeBody(body), ProtocolError);
  }
}

TEST_CASE("heartbeats decode the same through the fast path and the JSON parser", "[protocol]") {
  // decodeBody matches the canonical heartbeat (what encode() writes) without
  // a JSON document; a trailing space takes the same body through the parser.
  const std::vector<std::string> numbers = {"0",  "-0",  "7",  "-1",  "01", "2147483647", "2147483648", "-2147483649",
                                            "999999999999999999", "9999999999999999999",
                                            "444444444444444444444444444444", "1.0", "1e3", "+1", "-"};
  std::vector<std::string> bodies = {encode(Heartbeat{-1, 0}).substr(4), encode(Heartbeat{999, 123456}).substr(4),
                                     R"({"step":5,"rank":1,"type":"heartbeat"})", R"({ "rank":1,"step":5,"type":"heartbeat"})",
                                     R"({"rank":1,"step":5,"type":"heartbeat"}x)", R"({"rank":1,"step":5,"type":"heartbeat")"};
  for (const auto& rank : numbers) {
    for (const auto& step : numbers) {
      for (const char* waiting : {"", R"(,"waiting":true)", R"(,"waiting":false)", R"(,"waiting":1)", R"(,"waiting":)"}) {
        bodies.push_back(R"({"rank":)" + rank + R"(,"step":)" + step + R"(,"type":"heartbeat")" + waiting + "}");
      }
    }
  }
  bodies.push_back(encode(Heartbeat{3, 4, true}).substr(4));
  auto decode = [](const std::string& body) -> std::optional<Message> {
    try {
      return decodeBody(body);
    } catch (const ProtocolError&) {
      return std::nullopt;
    }
  };
  for (const auto& body : bodies) {
    INFO(body);
    CHECK(decode(body) == decode(body + " "));
  }
  CHECK(decode(encode(Heartbeat{12, 34}).substr(4)) == Message(Heartbeat{12, 34}));
  CHECK(decode(encode(Heartbeat{12, 34, true}).substr(4)) == Message(Heartbeat{12, 34, true}));
  CHECK(decode(R"({"rank":1,"step":2,"type":"heartbeat"})") == Message(Heartbeat{1, 2, false}));  // before "waiting"
}

TEST_CASE("worker_beats decode the same through the fast path and the JSON parser", "[protocol]") {
  // What encode() writes takes the fast path (protocol_canonical.h); a
  // trailing space takes the same body through the parser. The two are
  // compared re-encoded (NaN != NaN as a double, "null" == "null" as text).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<WorkerBeats> relays = {
      WorkerBeats{3, {}, {}},
      WorkerBeats{7, {{0, 12, false}, {5, -1, true}, {2147483647, 999999999999999999, false}}, {}},
      WorkerBeats{1, {}, {{4, 1, 0, 9, 2.5, 0.25, 0.0125}, {5, 2, 1, 10, nan, inf, -inf}}},
      WorkerBeats{-1, {{1, 2, true}}, {{-3, 0, 0, -7, 1e-300, 1.7976931348623157e308, 5e-324},
                                        {0, 0, 0, 0, -0.0, 0.1 + 0.2, 1.0 / 3.0}}}};
  for (const auto& relay : relays) {
    const std::string body = encode(relay).substr(4);
    INFO(body);
    CHECK(varuna::proto::canonical::workerBeats(body).has_value());
    CHECK(encode(decodeBody(body)) == encode(relay));
    CHECK(encode(decodeBody(body)) == encode(decodeBody(body + " ")));
  }
  const std::string head = R"({"beats":[[1,2,true]],"generation":4,"reports":[[1,0,0,)";
  const std::string tail = R"(]],"type":"worker_beats"})";
  const std::vector<std::string> reportTails = {
      "5,1.5,0.5,0.25",  "5,-0,0.5,0.25",  "5,-0.0,1,2",      "5,01,1,2",    "5,1.,1,2",   "5,.5,1,2",
      "5,1e400,1,2",     "5,1E-2,1e+2,3", "5,null,null,null", "5,nan,1,2",   "5,inf,1,2",  "5,+1,1,2",
      "5.0,1,1,2",       "-0,1,1,2",      "5,1,1",            "5,1,1,2,3",   "5,\"1\",1,2", "99999999999999999999,1,1,2",
      "5,1 ,1,2",        "5,true,1,2",    "5,12345678901234567890123,1,2"};
  std::vector<std::string> bodies;
  for (const auto& r : reportTails) bodies.push_back(head + r + tail);
  for (const char* b : {R"({"beats":[],"generation":2,"type":"worker_beats"})",
                               R"({"beats":[[1,2]],"generation":2,"reports":[],"type":"worker_beats"})",
                               R"({"beats":[[1,2,1]],"generation":2,"reports":[],"type":"worker_beats"})",
                               R"({"beats":[[2147483648,2,true]],"generation":2,"reports":[],"type":"worker_beats"})",
                               R"({"beats":[[1,2,true],],"generation":2,"reports":[],"type":"worker_beats"})",
                               R"({"beats":[],"generation":2,"reports":[],"type":"worker_beats","x":1})",
                               R"({"generation":2,"beats":[],"reports":[],"type":"worker_beats"})",
                               R"({"beats":[],"generation":2,"reports":[],"type":"heartbeat"})",
                               R"({"beats":[],"generation":2,"reports":[]})"}) {
    bodies.push_back(b);
  }
  const auto decoded = [](const std::string& body) -> std::string {
    try {
      return encode(decodeBody(body));
    } catch (const ProtocolError&) {
      return "refused";
    }
  };
  for (const auto& body : bodies) {
    INFO(body);
    CHECK(decoded(body) == decoded(body + " "));
  }
  // Some of them are refused either way, some taken; both kinds are there.
  CHECK(decoded(head + "5,01,1,2" + tail) == "refused");
  // An integer field takes JSON integers in its range only (the parser used
  // to cast 1e20 or 5.0 into an int64_t: undefined behaviour for 1e20).
  CHECK(decoded(head + "99999999999999999999,1,1,2" + tail) == "refused");
  CHECK(decoded(head + "5.0,1,1,2" + tail) == "refused");
  CHECK(decoded(head + "5,1E-2,1e+2,3" + tail) != "refused");
  CHECK(std::signbit(std::get<WorkerBeats>(decodeBody(head + "5,-0.0,1,2" + tail)).reports[0].loss));
}

TEST_CASE("integer fields take JSON integers within their range, nothing else", "[protocol]") {
  CHECK(decodeBody(R"({"type":"exit_now","generation":3,"reason":""})") == Message(ExitNow{3, ""}));
  for (const char* generation : {"3.0", "3e0", "1e300", "-1e300", "2147483648", "-2147483649", "18446744073709551615",
                                 "99999999999999999999", "true", "\"3\"", "null", "[3]"}) {
    const std::string body = std::string(R"({"type":"exit_now","generation":)") + generation + R"(,"reason":""})";
    INFO(body);
    CHECK_THROWS_WITH(decodeBody(body), Catch::Contains("malformed message"));
  }
  CHECK(decodeBody(R"({"type":"exit_now","generation":2147483647,"reason":""})") == Message(ExitNow{2147483647, ""}));
  CHECK(decodeBody(R"({"type":"exit_now","generation":-2147483648,"reason":""})") == Message(ExitNow{-2147483648, ""}));
  // An int64_t field (a beat's step) to its own limits; a nested rank too.
  CHECK(std::get<WorkerBeats>(decodeBody(R"({"beats":[[1,9223372036854775807,false]],"generation":1,"type":"worker_beats"})"))
            .beats[0]
            .step == std::numeric_limits<int64_t>::max());
  CHECK_THROWS_WITH(decodeBody(R"({"beats":[[1,9223372036854775808,false]],"generation":1,"type":"worker_beats"})"),
                    Catch::Contains("malformed message"));
  CHECK_THROWS_WITH(decodeBody(R"({"beats":[[3e9,1,false]],"generation":1,"type":"worker_beats"})"),
                    Catch::Contains("malformed message"));
}

TEST_CASE("checkpoint_failed: malformed bodies are refused, long or invalid error texts are bounded", "[protocol]") {
  CHECK_THROWS_WITH(decodeBody(R"({"type":"checkpoint_failed","rank":1,"step":2})"), Catch::Contains("malformed message"));
  CHECK_THROWS_WITH(decodeBody(R"({"type":"checkpoint_failed","rank":1,"step":"x","error":""})"),
                    Catch::Contains("malformed message"));
  CHECK_THROWS_WITH(decodeBody(R"({"type":"checkpoint_failed","rank":1,"step":2,"error":7})"),
                    Catch::Contains("malformed message"));

  // The sender's codec cuts a long text; a peer that sends one anyway is cut on decoding.
  const CheckpointFailed longError{0, 9, std::string(5000, 'e')};
  const std::string frame = encode(longError);
  CHECK(frame.size() < 4 + kMaxErrorTextBytes + 100);
  const auto sent = std::get<CheckpointFailed>(decodeBody(frame.substr(4)));
  CHECK(sent.error.size() == kMaxErrorTextBytes);
  CHECK(sent.error.substr(sent.error.size() - 3) == "...");
  const std::string raw = R"({"type":"checkpoint_failed","rank":0,"step":9,"error":")" + std::string(100000, 'e') + "\"}";
  CHECK(std::get<CheckpointFailed>(decodeBody(raw)).error.size() == kMaxErrorTextBytes);

  // An error text with bytes that are not UTF-8 (a path, a strerror of another
  // locale) still encodes: the JSON encoder would refuse it as it is.
  const auto odd = std::get<CheckpointFailed>(decodeBody(encode(CheckpointFailed{1, 2, "bad \xff\xfe name"}).substr(4)));
  CHECK(odd.error == "bad ?? name");
}

TEST_CASE("boundedText: valid UTF-8, cut at a character boundary, marked when cut", "[protocol]") {
  CHECK(boundedText("") == "");
  CHECK(boundedText("disk full", 9) == "disk full");  // exactly the limit: as it is
  CHECK(boundedText("disk full!", 9) == "disk f...");
  CHECK(boundedText("abcdef", 2) == "..");
  // "é" is two bytes: never cut in half.
  CHECK(boundedText("\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9", 7) == "\xc3\xa9\xc3\xa9...");
  CHECK(boundedText("\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9", 8) == "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9");
  CHECK(boundedText("ab\xc3\xa9\xc3\xa9\xc3\xa9", 6) == "ab...");
  // Invalid sequences: a lone continuation byte, a truncated sequence, an
  // overlong form, a surrogate; a 4-byte character stays.
  CHECK(boundedText("a\x80" "b") == "a?b");
  CHECK(boundedText("a\xe2\x82") == "a??");
  CHECK(boundedText("\xc0\xaf") == "??");
  CHECK(boundedText("\xed\xa0\x80") == "???");
  CHECK(boundedText("\xf0\x9f\x92\xbe") == "\xf0\x9f\x92\xbe");
}

TEST_CASE("an agent's relay stands for its heartbeat; its first relay comes at its phase", "[protocol]") {
  using std::chrono::milliseconds;
  // At most 500 ms of the interval count, plus 100 ms of timer slack.
  CHECK(relayStandsForHeartbeat(milliseconds(100)) == milliseconds(200));
  CHECK(relayStandsForHeartbeat(milliseconds(500)) == milliseconds(600));
  CHECK(relayStandsForHeartbeat(milliseconds(1000)) == milliseconds(600));
  // Agents started together relay spread over the interval, not together.
  CHECK(firstRelayDelay(milliseconds(500), 0.0) == milliseconds(0));
  CHECK(firstRelayDelay(milliseconds(500), 0.5) == milliseconds(250));
  CHECK(firstRelayDelay(milliseconds(500), 0.999) == milliseconds(499));
  CHECK(firstRelayDelay(milliseconds(500), -1.0) == milliseconds(0));  // clamped to the interval
  CHECK(firstRelayDelay(milliseconds(500), 7.0) == milliseconds(500));
}
