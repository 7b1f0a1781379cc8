/**
 * The synchronous part of the file I/O module (./fileIo.ts): the blocking `node:fs` calls that
 * code outside Effect makes, named here so that `node:fs` is imported in one place. Its users
 * are the command line (one-shot commands, bundled without Effect for start-up time: this module
 * loads nothing but `node:fs`), the HTTP token file (read by `agentd http-token` too), the SDK's
 * cursor file and its URL transport's token lookup, the web page's files (read once at start),
 * the socket server's claim and removal of its socket path (run once at start and stop: kept
 * synchronous, as the socket's life around a graceful stop is timed by them), the worker
 * entry's lookup, and the worker hosts' private socket directory and sockets (made and removed
 * in node's callbacks). Effect code uses ./fileIo.ts instead:
 * a blocking call inside Effect.gen stalls every fiber of the daemon.
 *
 * (The bin shim, src/bin/agentd.cts, stays on `require("node:fs")`: it is CommonJS, loaded
 * before anything else, and cannot import an ES module synchronously.)
 */
export {
  chmodSync,
  closeSync,
  constants,
  existsSync,
  fsyncSync,
  linkSync,
  lstatSync,
  mkdirSync,
  mkdtempSync,
  openSync,
  readdirSync,
  readFileSync,
  readlinkSync,
  readSync,
  renameSync,
  rmSync,
  statSync,
  unlinkSync,
  writeFileSync
} from "node:fs"
