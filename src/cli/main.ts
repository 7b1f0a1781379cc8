/**
 * The `agentd` command line: its commands described once (grammar and help), parsed here; the
 * command's program runs from run.ts (docs/protocol.md section 8 for the exit codes: 0 success,
 * 1 error reported by the daemon or a turn that did not finish, 2 usage error, 3 daemon not
 * reachable, 130 interrupted by Ctrl-C).
 *
 * A command line is a short-lived process, so each part loads only when needed: this module
 * and the one-shot commands (commands.ts) load no Effect; run.ts brings Effect and the
 * client SDK for `prompt`, `attach`, `serve --detach` and `logs`, through `hooks.loadRun`;
 * `serve` loads the daemon's program (its own copy of Effect) through `hooks.loadServe`, and
 * nothing of run.ts: the daemon starts in every test and at every restart.
 */
import { type CommandSpec, commandHelp, mainHelp, type OptionSpec, parse, usageLine, useColor } from "./args.js"
import { type Context, runOneShot } from "./commands.js"
import { builtinEngines } from "./engines.js"
import { report } from "./errors.js"
import { EXIT } from "./exitCodes.js"
import { parseListen } from "../internal/http/listen.js"
import { addressOf, serveOptionsOf } from "./paths.js"

/** A HOST:PORT option (`--http`, `--runner-address`): what is wrong with it, or undefined. */
const checkListen = (value: string): string | undefined => {
  const listen = parseListen(value)
  return typeof listen === "string" ? listen : undefined
}

export const VERSION = "0.1.0"

/** What the entry point gives the command line. */
export interface Hooks {
  /** Loads the programs of the commands that run on Effect (run.ts: a bundle of its own). */
  readonly loadRun: () => Promise<typeof import("./run.js")>
  /** Loads the daemon's program (a separate module: only `serve` needs it). */
  readonly loadServe: () => Promise<{ readonly serve: (options: ServeOptions) => void }>
  /** How to start this command line again in another process (`serve --detach`). */
  readonly self: ReadonlyArray<string>
}

/** `agentd serve`'s options, resolved. */
export interface ServeOptions {
  readonly stateDir: string
  readonly socketPath: string
  readonly engine: string | undefined
  readonly maxWorkers: number | undefined
  readonly sessionsPerWorker?: number | undefined
  readonly shutdownGraceMs: number | undefined
  readonly logLevel: string | undefined
  readonly store?: string | undefined
  /** `HOST:PORT` of the HTTP front, if asked for. */
  readonly http?: string | undefined
  readonly httpInsecure?: boolean | undefined
  /** Run as a cluster runner (docs/cluster.md). */
  readonly cluster?: boolean | undefined
  /** `HOST:PORT` of this runner. */
  readonly runnerAddress?: string | undefined
}

// ---------------------------------------------------------------------------------------------
// The grammar
// ---------------------------------------------------------------------------------------------

const stateDirOption: OptionSpec = {
  name: "state-dir",
  kind: "string",
  value: "DIR",
  description: "The daemon's state directory (default $AGENTD_HOME, else $XDG_STATE_HOME/agentd, else ~/.local/state/agentd)."
}
const socketOption: OptionSpec = {
  name: "socket",
  kind: "string",
  value: "PATH",
  description: "The daemon's socket (default $AGENTD_SOCKET, else <state dir>/agentd.sock)."
}
const urlOption: OptionSpec = {
  name: "url",
  kind: "string",
  value: "URL",
  description:
    "Reach the daemon over the network instead: the URL of its `serve --http` (http://HOST:PORT; default $AGENTD_URL). The token comes from $AGENTD_TOKEN, else (a loopback URL) from <state dir>/http-token."
}
const jsonOption: OptionSpec = { name: "json", kind: "flag", description: "Print JSON (one value) instead of text." }
const jsonLinesOption: OptionSpec = { name: "json", kind: "flag", description: "Print JSON lines (one per event) instead of text." }
const where = [stateDirOption, socketOption]
/** Where a client command finds the daemon: its socket, or its URL. */
const reach = [...where, urlOption]
const common = [...reach, jsonOption]
const streaming = [...reach, jsonLinesOption]
const targetArg = {
  name: "TARGET",
  description: "The session: its id, a unique prefix of the id (the s- may be left out), or its name."
}

export const commands: ReadonlyArray<CommandSpec> = [
  {
    name: "serve",
    summary: "Run the daemon (in the foreground, logging to stderr; --detach: in the background).",
    details:
      "Stops gracefully on SIGINT or SIGTERM (or `agentd shutdown`) and exits 0. With --detach the daemon runs in the background with its log in <state dir>/agentd.log (`agentd logs`), and this command returns once it listens, or says why it could not start.",
    args: [],
    options: [
      ...where,
      {
        name: "engine",
        kind: "string",
        value: "NAME",
        choices: builtinEngines,
        description: "The engine of sessions created without one (default echo)."
      },
      {
        name: "max-workers",
        kind: "integer",
        value: "N",
        min: 1,
        description: "Live session workers beyond which the least recently used idle session is passivated (default 32)."
      },
      {
        name: "sessions-per-worker",
        kind: "integer",
        value: "N",
        min: 1,
        description:
          "Sessions one worker process runs at most (default 1, or $AGENTD_SESSIONS_PER_WORKER). Above 1, sessions share processes: much less CPU at a model's pace, but a crash interrupts every session of its process."
      },
      {
        name: "shutdown-grace-ms",
        kind: "integer",
        value: "MS",
        description:
          "At a graceful stop, how long clients may take to read what they are owed before every connection is closed (default 3000, or $AGENTD_SHUTDOWN_GRACE_MS)."
      },
      {
        name: "store",
        kind: "string",
        value: "STORE",
        description:
          "Where sessions, events and the recovery journal are kept: `files` (the state dir, the default) or a PostgreSQL database, postgres://user@host/db (default $AGENTD_STORE)."
      },
      {
        name: "log-level",
        kind: "string",
        value: "LEVEL",
        choices: ["debug", "info", "warning", "error", "none"],
        description: "The least severe log messages written (default info)."
      },
      {
        name: "http",
        kind: "string",
        value: "HOST:PORT",
        check: checkListen,
        description: "Also serve HTTP, SSE and WebSocket there (e.g. 127.0.0.1:7433; default $AGENTD_HTTP, else off). Every request needs the token `agentd http-token` prints."
      },
      {
        name: "http-insecure",
        kind: "flag",
        description: "Allow --http on an address that is not loopback (put TLS in front of it)."
      },
      {
        name: "cluster",
        kind: "flag",
        description:
          "Run as one runner of a cluster: sessions are sharded over every runner of the same --store (PostgreSQL only), any runner takes any session's commands (docs/cluster.md; default $AGENTD_CLUSTER)."
      },
      {
        name: "runner-address",
        kind: "string",
        value: "HOST:PORT",
        check: checkListen,
        description: "With --cluster: where the other runners reach this one, and where it listens (default $AGENTD_RUNNER_ADDRESS, else <hostname>:34431)."
      },
      { name: "detach", kind: "flag", description: "Start the daemon in the background and return once it listens." },
      { name: "json", kind: "flag", description: "With --detach: print the daemon's pid, socket and log file as JSON." }
    ],
    examples: [
      "agentd serve",
      "agentd serve --detach --state-dir /tmp/agentd",
      "agentd serve --http 127.0.0.1:7433",
      "agentd serve --store postgres://agentd@localhost/agentd",
      "agentd serve --store postgres://agentd@db/agentd --cluster --runner-address 10.0.0.5:34431"
    ]
  },
  {
    name: "status",
    summary: "Show the daemon's status (pid, uptime, sessions, workers).",
    args: [],
    options: common
  },
  {
    name: "create",
    summary: "Create a session and print its id.",
    details:
      "A name makes the session a target for the other commands; a name already in use is refused (the daemon keeps names unique). --engine chooses the session's engine (default: the daemon's, `serve --engine`); --config gives its options as a JSON object and --set one option at a time (repeatable, after --config), its value read by the option's type (a number, true/false, or text). The daemon checks them with the engine's own validation and names the option it refuses.",
    args: [],
    options: [
      { name: "name", kind: "string", value: "NAME", description: "A name for the session (unique)." },
      { name: "engine", kind: "string", value: "NAME", description: `The session's engine (built in: ${builtinEngines.join(", ")}; default: the daemon's).` },
      { name: "config", kind: "string", value: "JSON", description: "The engine's options, a JSON object (e.g. '{\"tokenDelayMs\":20}')." },
      {
        name: "set",
        kind: "string",
        value: "KEY=VALUE",
        repeatable: true,
        description: "One engine option (repeatable; over --config): tokenDelayMs=20, model=gpt-4o-mini, temperature=0.2."
      },
      ...common
    ],
    examples: [
      "agentd create --name demo",
      "agentd create --name slow --set tokenDelayMs=50",
      "agentd create --engine openai-compat --set baseUrl=http://127.0.0.1:8080/v1 --set model=llama3"
    ]
  },
  {
    name: "sessions",
    summary: "List the sessions (a table on a terminal, tab-separated with a header when piped).",
    args: [],
    options: common
  },
  {
    name: "prompt",
    summary: "Send a prompt and stream the reply to stdout until the turn ends.",
    details:
      "TEXT `-` reads the prompt from stdin (for prompts of any size), as does --file -. Exits 0 when the turn ends, 1 when it was interrupted (the reason on stderr) or refused. When the daemon goes away during the turn, prompt reconnects to see the turn's end (a restarted daemon ends it with turn_interrupted: exit 1), for --reconnect-timeout, then gives up with exit 3. Ctrl-C aborts the turn, waits for its end and exits 130. With --json each event of the turn is printed as a JSON line.",
    args: [targetArg, { name: "TEXT", description: "The prompt, or - to read it from stdin.", optional: true }],
    options: [
      { name: "file", kind: "string", value: "PATH", description: "Read the prompt from a file (- for stdin)." },
      {
        name: "reconnect-timeout",
        kind: "integer",
        value: "SECONDS",
        description: "How long to keep reconnecting to a daemon that went away during the turn, to see its end (default 30)."
      },
      ...streaming
    ],
    examples: ["agentd prompt demo \"hello there\"", "cat notes.md | agentd prompt demo -", "agentd prompt demo --file notes.md"]
  },
  {
    name: "attach",
    summary: "Follow a session live: history, a separator, then its turns as they happen.",
    details:
      "stdout shows user messages (> ...), the assistant's text as it streams, tool calls and results on one line each, and the end of each turn; stderr gets one-line notices: the worker recovering and ready, the connection lost and back, a daemon restart, a resync, a rewritten history. A killed session ends the command with exit 1. When the daemon goes away, attach reconnects and resumes by cursor for --reconnect-timeout, then gives up with exit 3. With --json each event is printed as a JSON line (history lines first, with --history). On a terminal (stdin and stdout), without --read-only or --json, attach also takes input on a line below the session: Enter sends the line as a prompt (during a turn it is refused: the session is busy; what is typed meanwhile is kept for later), Ctrl-C aborts a running turn, Ctrl-C when idle or Ctrl-D detaches (exit 0); commands: /abort, /checkpoint, /retry, /log [N] (the last N messages, default 20), /detach, /help; any other line, the echo engine's /sleep and /bulk included, is a prompt (//x sends /x).",
    args: [targetArg],
    options: [
      {
        name: "history",
        kind: "integer",
        value: "N",
        description: "Show the last N messages of the transcript first (default 20, or 0 with --json; 0 for none; not with --from)."
      },
      {
        name: "from",
        kind: "string",
        value: "CURSOR",
        description: "Follow from this cursor (GENERATION:SEQUENCE, e.g. 2:17): show the events after it."
      },
      {
        name: "reconnect-timeout",
        kind: "integer",
        value: "SECONDS",
        description: "How long to keep reconnecting to a daemon that went away (default 30)."
      },
      { name: "read-only", kind: "flag", description: "Only show the session, take no input (as when stdin or stdout is not a terminal)." },
      ...streaming
    ]
  },
  {
    name: "log",
    summary: "Print a session's transcript (all of it, or a part), fetched page by page.",
    args: [targetArg],
    options: [
      { name: "tail", kind: "integer", value: "N", description: "Only the last N messages." },
      { name: "offset", kind: "integer", value: "N", description: "Start at message N (from 0)." },
      { name: "limit", kind: "integer", value: "N", description: "At most N messages." },
      ...common
    ]
  },
  {
    name: "state",
    summary: "Show a session's state (worker, busy, messages, restarts, last cursor).",
    args: [targetArg],
    options: common
  },
  { name: "abort", summary: "Abort the turn running in a session.", args: [targetArg], options: common },
  {
    name: "retry",
    summary: "Start the worker of a session again (after it failed: restarted too often).",
    args: [targetArg],
    options: common
  },
  {
    name: "checkpoint",
    summary: "Take a checkpoint of a session now (a new generation); prints it once durable.",
    args: [targetArg],
    options: common
  },
  {
    name: "rename",
    summary: "Give a session a new name (unique among the daemon's sessions).",
    args: [targetArg, { name: "NAME", description: "The new name." }],
    options: common,
    examples: ["agentd rename demo notes"]
  },
  {
    name: "kill",
    summary: "Kill a session and print its id (its files move to the state dir's archive).",
    args: [targetArg],
    options: common
  },
  {
    name: "shutdown",
    summary: "Stop the daemon (gracefully: it answers, then exits).",
    args: [],
    options: common
  },
  {
    name: "http-token",
    summary: "Print the token of the daemon's HTTP front (made now if there is none yet).",
    details:
      "Requests to `serve --http` carry it as `Authorization: Bearer <token>`; a browser logs in once through http://HOST:PORT/login?token=<token>, which sets an HttpOnly cookie. The token lives in <state dir>/http-token (0600).",
    args: [],
    options: [stateDirOption]
  },
  {
    name: "web",
    summary: "Open the daemon's web page in a browser (prints its login link where none can be opened).",
    details:
      "The page is served by `serve --http HOST:PORT` at /; the link logs the browser in once (it holds the token, so keep it to yourself).",
    args: [],
    options: [
      stateDirOption,
      { name: "http", kind: "string", value: "HOST:PORT", description: "Where the daemon serves HTTP (what `serve --http` was given; default $AGENTD_HTTP)." },
      { name: "print", kind: "flag", description: "Only print the login link; do not open a browser." }
    ]
  },
  {
    name: "logs",
    summary: "Print the log of a daemon started with `serve --detach` (-f: keep following it).",
    args: [],
    options: [
      stateDirOption,
      { name: "follow", short: "f", kind: "flag", description: "Keep printing what is appended." },
      { name: "lines", short: "n", kind: "integer", value: "N", description: "Only the last N lines (default: all)." }
    ]
  }
]

const EPILOGUE = `Run \`agentd help COMMAND\` (or \`agentd COMMAND --help\`) for a command's options.

Sessions are named by their id, a unique prefix of it (the s- may be left out), or their name.
Exit codes: 0 success, 1 error reported by the daemon or a turn that did not finish, 2 usage
error, 3 daemon not reachable, 130 interrupted (Ctrl-C).

The echo engine (the default) answers "echo: " and the prompt's words, and takes special
prompts for trying things out: /sleep MS (a tool call that waits MS ms: a turn to abort or to
crash a worker in), /bulk N (a reply of exactly N bytes), /compact (rewrites the history into
one message).`

/** Runs the command line; resolves with the exit code. */
export const main = async (argv: ReadonlyArray<string>, hooks: Hooks): Promise<number> => {
  const result = parse(commands, argv)
  switch (result._tag) {
    case "Version":
      process.stdout.write(`agentd ${VERSION}\n`)
      return EXIT.ok
    case "Help":
      process.stdout.write(
        result.command === undefined ? mainHelp(commands, useColor(process.stdout), EPILOGUE) : commandHelp(result.command, useColor(process.stdout))
      )
      return EXIT.ok
    case "UsageError":
      process.stderr.write(
        `agentd: ${result.message}\n${result.command === undefined ? "Run `agentd help` for the commands." : `Usage: ${usageLine(result.command)}\nRun \`agentd help ${result.command.name}\` for more.`}\n`
      )
      return EXIT.usage
    case "Run": {
      // A reader that went away (`agentd log x | head`): stop quietly, as `cat` would.
      process.stdout.on("error", (e: NodeJS.ErrnoException) => {
        if (e.code === "EPIPE") process.exit(EXIT.ok)
        throw e
      })
      const p = result.parsed
      const address = addressOf(p)
      if (typeof address !== "string") {
        process.stderr.write(`agentd: ${address.error}\nUsage: ${usageLine(p.command)}\n`)
        return EXIT.usage
      }
      const ctx: Context = {
        socketPath: address,
        json: p.options.get("json") === true,
        color: useColor(process.stdout),
        stdoutIsTTY: process.stdout.isTTY === true
      }
      if (p.command.name === "serve" && p.options.get("detach") !== true) {
        // The daemon's runtime owns the process from here (signals, exit code): the promise
        // never settles and holds nothing open, so the process ends when the daemon does.
        let daemon: Awaited<ReturnType<Hooks["loadServe"]>>
        try {
          daemon = await hooks.loadServe()
        } catch (e) {
          return report(e, p.command)
        }
        daemon.serve(serveOptionsOf(p, address))
        return new Promise<never>(() => {})
      }
      const oneShot = runOneShot(p, ctx)
      if (oneShot !== undefined) return oneShot.then(() => EXIT.ok, (e: unknown) => report(e, p.command))
      // The commands that follow events (and Effect) load only now.
      return (await hooks.loadRun()).run(p, ctx, hooks)
    }
  }
}
