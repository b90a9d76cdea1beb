// An HTTP/2 server in Node.js for tests/tests/http2.rs (cleartext, prior knowledge):
// each stream answered after SERVICE_MS by a HEADERS frame (`:status 200`) that ends
// it, from a timer on Node's one event loop, so every open stream is served at once.
//
//     node node_server.js SERVICE_MS
//
// Prints `port N` once it listens on 127.0.0.1; serves until stdin closes, then
// prints `served N`: the streams it answered.
"use strict";
const http2 = require("node:http2");

const serviceMs = Number(process.argv[2] || "20");
let served = 0;
const server = http2.createServer();
server.on("stream", (stream) => {
  setTimeout(() => {
    if (!stream.destroyed) {
      stream.respond({ ":status": 200 }, { endStream: true });
      served += 1;
    }
  }, serviceMs);
});
server.listen(0, "127.0.0.1", () => {
  console.log(`port ${server.address().port}`);
});
process.stdin.resume();
process.stdin.on("end", () => {
  console.log(`served ${served}`);
  process.exit(0);
});
