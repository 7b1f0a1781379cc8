/**
 * The public wire protocol of agentd, version 1 (docs/protocol.md sections 2-5).
 *
 * Every message is one JSON object per line, discriminated on `type`. Inbound lines are decoded
 * with {@link decodeCommandLine}, which never throws and maps every failure to one of the
 * documented error codes; outbound messages are plain typed objects written with {@link encode}.
 */
import * as Arr from "effect/Array"
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import { isRecord } from "effect/Predicate"
import * as Schema from "effect/Schema"
import { Cursor } from "./Cursor.js"

// ---------------------------------------------------------------------------------------------
// Shared pieces
// ---------------------------------------------------------------------------------------------

/**
 * A struct discriminated by a literal `type` field, as on the wire. Messages are kept in memory
 * exactly as they travel, so encoding is one `JSON.stringify` and nothing is renamed.
 */
export const Tagged = <const T extends string, Fields extends Schema.Struct.Fields>(type: T, fields: Fields) =>
  Schema.Struct({ type: Schema.tag(type), ...fields })

/** The identity of this protocol, carried by envelopes and `daemon_hello`. */
export const ProtocolId = Schema.Struct({
  name: Schema.Literal("agentd"),
  version: Schema.Literal(1)
})
export type ProtocolId = typeof ProtocolId.Type

/** The one protocol this daemon speaks. */
export const PROTOCOL: ProtocolId = { name: "agentd", version: 1 }

/**
 * Any JSON value. Fields the daemon treats as opaque (engine config, tool arguments) use it;
 * the arbitrary is JSON-only so round-trip property tests stay on the wire's domain.
 */
export const Json: Schema.Schema<unknown> = Schema.Unknown.annotations({
  identifier: "Json",
  arbitrary: () => (fc) => fc.jsonValue({ maxDepth: 2 }).map((v) => JSON.parse(JSON.stringify(v)) as unknown)
})

/**
 * A key of a decoded record. Decoding drops a `__proto__` key (JSON.parse makes it an own key;
 * assigning it to the decoded record would set the prototype instead), so such a key never
 * survives a round trip; the filter keeps generated test records to keys that do.
 */
const RecordKey = Schema.String.pipe(Schema.filter((key) => key !== "__proto__"))

/** A JSON object with arbitrary values. */
export const JsonObject = Schema.Record({ key: RecordKey, value: Json })

/** A map of environment variables. */
export const EnvMap = Schema.Record({ key: RecordKey, value: Schema.String })

/**
 * An optional field that, when present, holds a value: JSON has no `undefined`, and with
 * `exactOptionalPropertyTypes` the types then say exactly what the wire carries.
 */
export const optional = <S extends Schema.Schema.All>(schema: S) => Schema.optionalWith(schema, { exact: true })

/** A non-negative integer. */
const NonNegativeInt = Schema.Int.pipe(Schema.nonNegative())

/** Milliseconds since the epoch. */
const EpochMillis = NonNegativeInt

/** Capabilities a client may announce at attach and the server announces in its hello. */
export const Capability = Schema.Literal("attach_snapshot", "event_sequence", "slim_attach", "chunked_snapshot")
export type Capability = typeof Capability.Type

/** The capabilities this daemon supports. */
export const SERVER_CAPABILITIES: ReadonlyArray<Capability> = [
  "attach_snapshot",
  "event_sequence",
  "slim_attach",
  "chunked_snapshot"
]

/** What a client gets when it sends no `capabilities`. */
export const DEFAULT_CLIENT_CAPABILITIES: ReadonlyArray<Capability> = ["attach_snapshot", "event_sequence"]

// ---------------------------------------------------------------------------------------------
// Agent messages and events (section 4)
// ---------------------------------------------------------------------------------------------

/** A message of a session's transcript. */
export const AgentMessage = Schema.Struct({
  id: Schema.String,
  role: Schema.Literal("user", "assistant", "tool"),
  content: Schema.String,
  toolCallId: optional(Schema.String),
  toolName: optional(Schema.String),
  /** On a `tool` message: the arguments of the call (so the transcript can be sent to a model again). */
  toolArgs: optional(Json),
  /** On a `tool` message: the tool failed; on an `assistant` message: the turn ended on this error. */
  isError: optional(Schema.Boolean),
  /** The message was being streamed when its turn was cut: `content` is the text streamed so far. */
  interrupted: optional(Schema.Boolean),
  timestamp: EpochMillis
})
export type AgentMessage = typeof AgentMessage.Type

/** Why a turn ended without `agent_end`. */
export const InterruptReason = Schema.Literal("worker_crashed", "aborted", "daemon_restarted", "daemon_shutdown", "storage_failed")
export type InterruptReason = typeof InterruptReason.Type

/**
 * Why a turn ended failed (`agent_end.error`): the model endpoint failed (an error status, a
 * refused connection, a cut or malformed stream, a timeout). `code` is stable (the built-in
 * model engines' codes are listed in docs/protocol.md section 7a: `http_status`, `auth`,
 * `connect_failed`, `timeout`, `stream_cut`, `malformed_response`, `endpoint_error`,
 * `tool_rounds_exceeded`, `unknown`); `message` is a sentence for a person; `status` is the
 * HTTP status when the endpoint answered one.
 */
export const TurnFailure = Schema.Struct({
  code: Schema.String,
  message: Schema.String,
  status: optional(Schema.Int)
})
export type TurnFailure = typeof TurnFailure.Type

/** The events the built-in engines emit. The supervisor treats them as opaque JSON. */
export const AgentEvent = Schema.Union(
  Tagged("agent_start", {}),
  Tagged("turn_start", {}),
  Tagged("message_start", { message: AgentMessage }),
  Tagged("message_update", { messageId: Schema.String, delta: Schema.String }),
  Tagged("message_end", { message: AgentMessage }),
  Tagged("tool_execution_start", { toolCallId: Schema.String, name: Schema.String, args: Json }),
  Tagged("tool_execution_end", { toolCallId: Schema.String, result: Json, isError: Schema.Boolean }),
  Tagged("turn_end", {}),
  /** `error`: the turn ended but did not succeed (its last assistant message has `isError`). */
  Tagged("agent_end", { error: optional(TurnFailure) }),
  Tagged("turn_interrupted", { reason: InterruptReason })
)
export type AgentEvent = typeof AgentEvent.Type

/** The lifecycle state of a session's worker. */
export const WorkerState = Schema.Literal("starting", "ready", "recovering", "passivated", "failed", "damaged", "closed")
export type WorkerState = typeof WorkerState.Type

/** What `list`, `get_state` and `session_status` report about a session. */
export const SessionSummary = Schema.Struct({
  activeSessionId: Schema.String,
  name: optional(Schema.String),
  engine: Schema.String,
  createdAt: Schema.String,
  messageCount: NonNegativeInt,
  busy: Schema.Boolean,
  worker: WorkerState,
  workerPid: optional(Schema.Int),
  restarts: NonNegativeInt,
  telemetry: Schema.Boolean,
  lastEventCursor: optional(Cursor),
  /** Why a `damaged` session's files did not load (docs/protocol.md section 6). */
  damage: optional(Schema.Struct({ reason: Schema.String })),
  /** Cluster mode only: the address (`HOST:PORT`) of the runner that owns the session (docs/cluster.md). */
  runner: optional(Schema.String)
})
export type SessionSummary = typeof SessionSummary.Type

/** `meta` of every sequenced event. */
export const EventMeta = Schema.Struct({
  cursor: Cursor,
  emittedAt: EpochMillis,
  replayed: optional(Schema.Literal(true))
})
export type EventMeta = typeof EventMeta.Type

// ---------------------------------------------------------------------------------------------
// Commands (section 3)
// ---------------------------------------------------------------------------------------------

const SessionRef = { activeSessionId: Schema.String }

/** The command schemas, each tagged by its `type`. */
export const Ping = Tagged("ping", {})
export const Create = Tagged("create", {
  name: optional(Schema.String),
  engine: optional(Schema.String),
  config: optional(JsonObject),
  telemetry: optional(Schema.Boolean),
  env: optional(EnvMap),
  launchEnv: optional(EnvMap)
})
export const List = Tagged("list", {})
export const Status = Tagged("status", {})
export const Attach = Tagged("attach", {
  ...SessionRef,
  // Unknown capability names are accepted and ignored, so newer clients can talk to us.
  capabilities: optional(Schema.Array(Schema.String)),
  resumeCursor: optional(Cursor),
  /** Continues a chunked snapshot that was cut off, from chunk `fromChunk`, while it is retained. */
  snapshotResume: optional(Schema.Struct({ snapshotId: Schema.String, fromChunk: NonNegativeInt })),
  telemetryDisabled: optional(Schema.Boolean),
  supportsExtensionUi: optional(Schema.Boolean),
  env: optional(EnvMap),
  launchEnv: optional(EnvMap),
  recoveryConfig: optional(Json)
})
export const Detach = Tagged("detach", SessionRef)
/**
 * A client's id for a prompt (docs/protocol.md section 9): the status that starts its turn
 * carries it, and a prompt sent again with an id whose turn started runs no second turn.
 */
export const PromptId = Schema.String.pipe(Schema.minLength(1), Schema.maxLength(128))
export const Prompt = Tagged("prompt", { ...SessionRef, message: Schema.String, promptId: optional(PromptId) })
export const Abort = Tagged("abort", SessionRef)
export const GetState = Tagged("get_state", SessionRef)
export const GetMessages = Tagged("get_messages", {
  ...SessionRef,
  offset: optional(NonNegativeInt),
  limit: optional(NonNegativeInt.pipe(Schema.lessThanOrEqualTo(1000)))
})
export const Checkpoint = Tagged("checkpoint", SessionRef)
export const RetryWorker = Tagged("retry_worker", SessionRef)
export const Kill = Tagged("kill", SessionRef)
/** Extension (docs/protocol.md section 3): gives a session a new name, unique as at `create`. */
export const Rename = Tagged("rename", { ...SessionRef, name: Schema.String })
export const Shutdown = Tagged("shutdown", {})

/** Every command, by its `type`. */
export const Commands = {
  ping: Ping,
  create: Create,
  list: List,
  status: Status,
  attach: Attach,
  detach: Detach,
  prompt: Prompt,
  abort: Abort,
  get_state: GetState,
  get_messages: GetMessages,
  checkpoint: Checkpoint,
  retry_worker: RetryWorker,
  kill: Kill,
  rename: Rename,
  shutdown: Shutdown
} as const

/** A command's `type`. */
export type CommandType = keyof typeof Commands

/** Any command. */
export const Command = Schema.Union(...Object.values(Commands))
export type Command = typeof Command.Type

/** A command of a given type. */
export type CommandOf<T extends CommandType> = Extract<Command, { readonly type: T }>

/** The envelope form of a command. */
export const CommandEnvelope = Schema.Struct({
  type: Schema.Literal("command"),
  id: Schema.String,
  protocol: ProtocolId,
  clientId: optional(Schema.String),
  command: Command
})
export type CommandEnvelope = typeof CommandEnvelope.Type

const isCommandType = (type: string): type is CommandType => Object.hasOwn(Commands, type)

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/** Every error code a `response` may carry. */
export const ErrorCode = Schema.Literal(
  "parse_error",
  "line_too_long",
  "invalid_command",
  "unknown_command",
  "unsupported_protocol",
  "session_not_found",
  "session_busy",
  "session_failed",
  "session_damaged",
  "name_taken",
  "storage_unavailable",
  "telemetry_policy_violation",
  "shutting_down",
  "internal"
)
export type ErrorCode = typeof ErrorCode.Type

/** The `error` object of a failed response. */
export const ErrorBody = Schema.Struct({
  code: ErrorCode,
  message: Schema.String,
  details: optional(JsonObject)
})
export type ErrorBody = typeof ErrorBody.Type

/**
 * A failure that becomes an error `response`: the code, a human sentence, and the id and
 * command type salvaged from the line (`null` / `"parse"` when none could be read).
 */
export class ProtocolError extends Schema.TaggedError<ProtocolError>()("ProtocolError", {
  code: ErrorCode,
  message: Schema.String,
  id: Schema.NullOr(Schema.String),
  command: Schema.String,
  details: optional(JsonObject)
}) {}

// ---------------------------------------------------------------------------------------------
// Server messages (sections 2-5)
// ---------------------------------------------------------------------------------------------

export const DaemonHello = Tagged("daemon_hello", {
  protocol: ProtocolId,
  clientId: Schema.String,
  supervisorGeneration: NonNegativeInt,
  supervisorPid: Schema.Int,
  appVersion: Schema.String,
  serverCapabilities: Schema.Array(Capability),
  /**
   * An extension of this implementation (docs/protocol.md section 9): the daemon's limits, so
   * that a client refuses up front what the daemon would refuse. A client ignores it if absent.
   */
  limits: optional(Schema.Struct({ maxLineBytes: Schema.Int.pipe(Schema.positive()) }))
})
export type DaemonHello = typeof DaemonHello.Type

export const ResponseSuccess = Tagged("response", {
  id: Schema.NullOr(Schema.String),
  command: Schema.String,
  success: Schema.Literal(true),
  data: Json
})
export const ResponseFailure = Tagged("response", {
  id: Schema.NullOr(Schema.String),
  command: Schema.String,
  success: Schema.Literal(false),
  error: ErrorBody
})
export const Response = Schema.Union(ResponseSuccess, ResponseFailure)
export type Response = typeof Response.Type

export const SessionEvent = Tagged("session_event", {
  activeSessionId: Schema.String,
  event: AgentEvent,
  meta: EventMeta
})
export const SessionStatus = Tagged("session_status", {
  activeSessionId: Schema.String,
  state: SessionSummary,
  /** On the status that starts a prompt's turn: the prompt's `promptId` (the client's, or a cluster runner's for a forwarded prompt). */
  promptId: optional(Schema.String),
  meta: EventMeta
})
export const SessionClosed = Tagged("session_closed", {
  activeSessionId: Schema.String,
  reason: Schema.String,
  meta: EventMeta
})
/** The messages that carry a cursor. */
export const SequencedMessage = Schema.Union(SessionEvent, SessionStatus, SessionClosed)
export type SequencedMessage = typeof SequencedMessage.Type

/** The replay decision of an attach (section 5). */
export const ReplayStatus = Schema.Literal("complete", "partial", "unavailable")
export const ReplayReason = Schema.Literal("cursor_ahead", "cursor_unknown", "cursor_expired", "no_cursor", "transcript_replaced")
export const Replay = Schema.Struct({
  status: ReplayStatus,
  reason: optional(ReplayReason),
  fromCursor: optional(Cursor),
  toCursor: optional(Cursor),
  eventCount: optional(NonNegativeInt)
})
export type Replay = typeof Replay.Type

export const SessionAttached = Tagged("session_attached", {
  activeSessionId: Schema.String,
  state: SessionSummary,
  replay: Replay,
  lastEventCursor: optional(Cursor)
})

export const SnapshotPurpose = Schema.Literal("attach", "replacement", "resync", "checkpoint")
export type SnapshotPurpose = typeof SnapshotPurpose.Type

export const SnapshotBegin = Tagged("session_snapshot_begin", {
  activeSessionId: Schema.String,
  snapshotId: Schema.String,
  messageCount: NonNegativeInt,
  targetChunkBytes: Schema.Int.pipe(Schema.positive()),
  purpose: SnapshotPurpose,
  cursor: optional(Cursor)
})
export const SnapshotChunk = Tagged("session_snapshot_chunk", {
  activeSessionId: Schema.String,
  snapshotId: Schema.String,
  index: NonNegativeInt,
  messages: Schema.Array(AgentMessage)
})
export const SnapshotEnd = Tagged("session_snapshot_end", {
  activeSessionId: Schema.String,
  snapshotId: Schema.String,
  chunkCount: NonNegativeInt,
  lastEventSequence: Schema.Int.pipe(Schema.greaterThanOrEqualTo(-1)),
  lastEventCursor: optional(Cursor)
})
export const SnapshotFailed = Tagged("session_snapshot_failed", {
  activeSessionId: Schema.String,
  snapshotId: Schema.String,
  error: ErrorBody
})

export const DaemonClosing = Tagged("daemon_closing", { reason: Schema.Literal("shutdown") })

/** The snapshot inside an attach result. */
export const AttachSnapshot = Schema.Struct({
  snapshotId: Schema.String,
  cursor: optional(Cursor),
  messageCount: NonNegativeInt,
  messages: Schema.Array(AgentMessage)
})

/** `data` of a successful `attach` response. */
export const DaemonAttachResult = Schema.Struct({
  protocol: ProtocolId,
  activeSessionId: Schema.String,
  state: optional(SessionSummary),
  messages: optional(Schema.Array(AgentMessage)),
  snapshot: AttachSnapshot,
  replay: Replay,
  lastEventSequence: Schema.Int.pipe(Schema.greaterThanOrEqualTo(-1)),
  lastEventCursor: optional(Cursor),
  snapshotStream: optional(
    Schema.Struct({
      id: Schema.String,
      messageCount: NonNegativeInt,
      targetChunkBytes: Schema.Int.pipe(Schema.positive())
    })
  ),
  client: Schema.Struct({ id: Schema.String, capabilities: Schema.Array(Schema.String) })
})
export type DaemonAttachResult = typeof DaemonAttachResult.Type

/**
 * Every message the daemon sends that is not an answer to a command: events, snapshot frames,
 * `session_attached` and `daemon_closing` (what a client reads as a stream).
 */
export const PushMessage = Schema.Union(
  SessionEvent,
  SessionStatus,
  SessionClosed,
  SessionAttached,
  SnapshotBegin,
  SnapshotChunk,
  SnapshotEnd,
  SnapshotFailed,
  DaemonClosing
)
export type PushMessage = typeof PushMessage.Type

/** Every message the daemon sends to a client: the hello, responses, and the pushed messages. */
export const ServerMessage = Schema.Union(DaemonHello, ResponseSuccess, ResponseFailure, ...PushMessage.members)
export type ServerMessage = typeof ServerMessage.Type

export type SessionEvent = typeof SessionEvent.Type
export type SessionStatus = typeof SessionStatus.Type
export type SessionClosed = typeof SessionClosed.Type
export type SessionAttached = typeof SessionAttached.Type
export type SnapshotBegin = typeof SnapshotBegin.Type
export type SnapshotChunk = typeof SnapshotChunk.Type
export type SnapshotEnd = typeof SnapshotEnd.Type
export type SnapshotFailed = typeof SnapshotFailed.Type
export type DaemonClosing = typeof DaemonClosing.Type
export type AttachSnapshot = typeof AttachSnapshot.Type

// ---------------------------------------------------------------------------------------------
// Response data (section 3): what `data` holds in a successful response, per command
// ---------------------------------------------------------------------------------------------

/** `data` of `ping`. */
export const PingResult = Schema.Struct({ pong: Schema.Literal(true) })
export type PingResult = typeof PingResult.Type

/** `data` of `create`: the new session (not attached: `create` never attaches). */
export const CreateResult = Schema.Struct({ activeSessionId: Schema.String, state: SessionSummary })
export type CreateResult = typeof CreateResult.Type

/** `data` of `list`. */
export const ListResult = Schema.Struct({ sessions: Schema.Array(SessionSummary) })
export type ListResult = typeof ListResult.Type

/** One worker process serving a session, as `status` lists it. */
export const WorkerInfo = Schema.Struct({
  pid: Schema.Int,
  activeSessionId: Schema.String,
  state: WorkerState,
  restarts: NonNegativeInt
})
export type WorkerInfo = typeof WorkerInfo.Type

/** `data` of `status`; `sessions` is a count. */
export const StatusResult = Schema.Struct({
  supervisorGeneration: NonNegativeInt,
  pid: Schema.Int,
  uptimeMs: NonNegativeInt,
  sessions: NonNegativeInt,
  workers: Schema.Array(WorkerInfo),
  /**
   * Extension: whether the recovery journal takes writes. `ok: false` (with the error) after a
   * journal write failed; new turns are refused `storage_unavailable` until one succeeds.
   */
  storage: optional(Schema.Struct({ ok: Schema.Boolean, error: optional(Schema.String) })),
  /** Cluster mode only: this runner's address. */
  runner: optional(Schema.String),
  /** Cluster mode only: the live runners, the shards each holds, and whether the cluster deems it healthy. */
  runners: optional(Schema.Array(Schema.Struct({ address: Schema.String, shards: NonNegativeInt, healthy: Schema.Boolean })))
})
export type StatusResult = typeof StatusResult.Type

/** `data` of `detach`, `kill` and `shutdown`: `{}` (any field a newer daemon adds is dropped). */
export const EmptyResult = Schema.Struct({})
export type EmptyResult = typeof EmptyResult.Type

/** `data` of `prompt`: sent once the turn has started (or, reserved, will start). */
export const PromptResult = Schema.Struct({ accepted: Schema.Literal(true) })
export type PromptResult = typeof PromptResult.Type

/** `data` of `abort`: whether a running turn ended with `turn_interrupted {reason: "aborted"}`. */
export const AbortResult = Schema.Struct({ aborted: Schema.Boolean })
export type AbortResult = typeof AbortResult.Type

/** `data` of `get_messages`: a page of the transcript and the transcript's length. */
export const GetMessagesResult = Schema.Struct({ messages: Schema.Array(AgentMessage), total: NonNegativeInt })
export type GetMessagesResult = typeof GetMessagesResult.Type

/** `data` of `checkpoint`: the generation the durable snapshot starts. */
export const CheckpointResult = Schema.Struct({
  generation: Schema.Int.pipe(Schema.greaterThanOrEqualTo(1)),
  snapshotId: Schema.String
})
export type CheckpointResult = typeof CheckpointResult.Type

/** The schema of a successful response's `data`, by command type. */
export const ResponseData = {
  ping: PingResult,
  create: CreateResult,
  list: ListResult,
  status: StatusResult,
  attach: DaemonAttachResult,
  detach: EmptyResult,
  prompt: PromptResult,
  abort: AbortResult,
  get_state: SessionSummary,
  get_messages: GetMessagesResult,
  checkpoint: CheckpointResult,
  retry_worker: SessionSummary,
  kill: EmptyResult,
  rename: SessionSummary,
  shutdown: EmptyResult
} as const satisfies { readonly [T in CommandType]: Schema.Schema<any, any, never> }

/** The decoded `data` of a successful response to a command of type `T`. */
export type ResponseDataOf<T extends CommandType> = Schema.Schema.Type<(typeof ResponseData)[T]>

/** One outbound message as a JSON line (with its `\n`). */
export const encode = (message: ServerMessage): string => JSON.stringify(message) + "\n"

/**
 * Decoders are compiled on first use, not at load: compiling one builds its whole parser, and
 * a process loading this module (a short-lived command line among them) needs few of them.
 */
const lazily = <A>(make: () => A): () => A => {
  let made: { readonly value: A } | undefined
  return () => (made ??= { value: make() }).value
}

const decodeServerMessageEither = lazily(() => Schema.decodeUnknownEither(ServerMessage))

/** Decodes one line sent by the daemon (used by clients and tests). */
export const decodeServerLine = (line: string): Either.Either<ServerMessage, ProtocolError> => {
  let json: unknown
  try {
    json = JSON.parse(line)
  } catch (e) {
    return Either.left(
      new ProtocolError({ code: "parse_error", message: `not JSON: ${String(e)}`, id: null, command: "parse" })
    )
  }
  return Either.mapLeft(
    decodeServerMessageEither()(json),
    (e) =>
      new ProtocolError({
        code: "invalid_command",
        message: ParseResult.TreeFormatter.formatErrorSync(e),
        id: null,
        command: "parse"
      })
  )
}

/** Encodes a command as the envelope a client sends. */
export const encodeCommand = (id: string, command: Command, clientId?: string): string =>
  JSON.stringify({
    type: "command",
    id,
    protocol: PROTOCOL,
    ...(clientId === undefined ? {} : { clientId }),
    command
  }) + "\n"

// ---------------------------------------------------------------------------------------------
// Decoding commands
// ---------------------------------------------------------------------------------------------

/** A decoded command with the id the response must echo (`null` when the line had none). */
export interface DecodedCommand {
  readonly id: string | null
  readonly clientId?: string
  readonly command: Command
}

const commandDecoders = Object.fromEntries(
  Object.entries(Commands).map(([type, schema]) => [type, lazily(() => Schema.decodeUnknownEither(schema as Schema.Schema<any>))])
) as Record<CommandType, () => (u: unknown) => Either.Either<Command, ParseResult.ParseError>>

// When a line is not JSON we still try to echo its id: the first `"id":"..."` pair found.
const salvageIdPattern = /"id"\s*:\s*"((?:[^"\\]|\\.)*)"/

const salvageId = (line: string): string | null => {
  const match = salvageIdPattern.exec(line.length > 4096 ? line.slice(0, 4096) : line)
  if (match === null) return null
  try {
    return JSON.parse(`"${match[1]}"`) as string
  } catch {
    return null
  }
}

const describe = (u: unknown): string => (u === null ? "null" : Array.isArray(u) ? "an array" : `a ${typeof u}`)

/** A value as JSON for an error message; a value nested too deeply to stringify is only described. */
const show = (u: unknown): string => {
  try {
    return JSON.stringify(u) ?? describe(u)
  } catch {
    return `${describe(u)} nested too deeply to show`
  }
}

/**
 * Decodes one inbound line into a command, or the {@link ProtocolError} to answer with.
 * Accepts the envelope form and the bare command form (section 3).
 */
export const decodeCommandLine = (line: string): Either.Either<DecodedCommand, ProtocolError> => {
  let json: unknown
  try {
    json = JSON.parse(line)
  } catch (e) {
    return Either.left(
      new ProtocolError({
        code: "parse_error",
        message: `The line is not valid JSON (${e instanceof Error ? e.message : String(e)}).`,
        id: salvageId(line),
        command: "parse"
      })
    )
  }
  return decodeCommandValue(json)
}

/** Like {@link decodeCommandLine}, from an already parsed JSON value. */
export const decodeCommandValue = (json: unknown): Either.Either<DecodedCommand, ProtocolError> => {
  if (!isRecord(json)) {
    return Either.left(
      new ProtocolError({
        code: "invalid_command",
        message: `A command must be a JSON object, got ${describe(json)}.`,
        id: null,
        command: "parse"
      })
    )
  }
  const rawId = json["id"]
  const id = typeof rawId === "string" ? rawId : null
  const fail = (code: ErrorCode, message: string, command: string) =>
    Either.left(new ProtocolError({ code, message, id, command }))

  let inner: unknown = json
  let clientId: string | undefined
  if (json["type"] === "command") {
    // Envelope: check its own fields before looking at the command inside.
    const innerType = isRecord(json["command"]) && typeof json["command"]["type"] === "string"
      ? json["command"]["type"]
      : "parse"
    if (typeof rawId !== "string") {
      return fail("invalid_command", "The envelope field `id` must be a string.", innerType)
    }
    const protocol = json["protocol"]
    if (protocol === undefined) {
      return fail("invalid_command", "The envelope field `protocol` is missing.", innerType)
    }
    if (!isRecord(protocol) || protocol["name"] !== PROTOCOL.name || protocol["version"] !== PROTOCOL.version) {
      return Either.left(
        new ProtocolError({
          code: "unsupported_protocol",
          message: `Unsupported protocol ${show(protocol)}; this daemon speaks ${
            JSON.stringify(PROTOCOL)
          }.`,
          id,
          command: innerType,
          details: { supported: PROTOCOL }
        })
      )
    }
    if (json["clientId"] !== undefined && typeof json["clientId"] !== "string") {
      return fail("invalid_command", "The envelope field `clientId` must be a string.", innerType)
    }
    if (!isRecord(json["command"])) {
      return fail(
        "invalid_command",
        json["command"] === undefined
          ? "The envelope field `command` is missing."
          : `The envelope field \`command\` must be an object, got ${describe(json["command"])}.`,
        innerType
      )
    }
    inner = json["command"]
    clientId = json["clientId"] as string | undefined
  } else if (rawId !== undefined && typeof rawId !== "string") {
    return fail("invalid_command", "The field `id` must be a string.", typeof json["type"] === "string" ? json["type"] : "parse")
  }

  const command = inner as Record<string, unknown>
  const type = command["type"]
  if (typeof type !== "string") {
    return fail(
      "invalid_command",
      type === undefined ? "The field `type` is missing." : "The field `type` must be a string.",
      "parse"
    )
  }
  if (!isCommandType(type)) {
    return fail("unknown_command", `Unknown command \`${type}\`.`, type)
  }
  const decoded = commandDecoders[type]()(command)
  if (Either.isLeft(decoded)) {
    return fail("invalid_command", invalidFieldMessage(type, decoded.left), type)
  }
  return Either.right(clientId === undefined ? { id, command: decoded.right } : { id, clientId, command: decoded.right })
}

/**
 * The paths of the failed leaves of a parse issue, without formatting any value. The tree is as
 * deep as the command schemas, never as deep as the input.
 */
const issuePaths = (issue: ParseResult.ParseIssue, path: ReadonlyArray<PropertyKey>, out: Array<string>): void => {
  switch (issue._tag) {
    case "Pointer":
      return issuePaths(issue.issue, [...path, ...(Array.isArray(issue.path) ? issue.path : [issue.path])], out)
    case "Composite":
      for (const inner of Array.isArray(issue.issues) ? issue.issues : [issue.issues]) issuePaths(inner, path, out)
      return
    case "Refinement":
    case "Transformation":
      return issuePaths(issue.issue, path, out)
    default:
      out.push(path.map(String).join("."))
  }
}

/** A one-line message naming the offending field(s) of a command. */
const invalidFieldMessage = (type: string, error: ParseResult.ParseError): string => {
  let issues: Array<ParseResult.ArrayFormatterIssue>
  try {
    issues = ParseResult.ArrayFormatter.formatErrorSync(error)
  } catch {
    // The formatter prints the offending value and recurses into it: a value nested thousands
    // deep overflows the stack. Name the fields without their values.
    const paths: Array<string> = []
    issuePaths(error.issue, [], paths)
    const parts = Arr.dedupe(paths).map((p) => `${p === "" ? "" : `\`${p}\`: `}invalid value (nested too deeply to show)`)
    return `Invalid \`${type}\` command: ${parts.join("; ")}`
  }
  const parts = Arr.map(issues, (issue) => {
    const path = issue.path.length === 0 ? "" : `\`${issue.path.join(".")}\`: `
    return `${path}${issue.message}`
  })
  return `Invalid \`${type}\` command: ${parts.join("; ")}`
}

/** A successful response. */
export const success = (id: string | null, command: string, data: unknown): ServerMessage => ({
  type: "response",
  id,
  command,
  success: true,
  data
})

/** A failed response. */
export const failure = (
  id: string | null,
  command: string,
  error: { readonly code: ErrorCode; readonly message: string; readonly details?: Record<string, unknown> | undefined }
): ServerMessage => ({
  type: "response",
  id,
  command,
  success: false,
  error: error.details === undefined
    ? { code: error.code, message: error.message }
    : { code: error.code, message: error.message, details: error.details }
})

/** The failed response that answers a {@link ProtocolError}. */
export const failureOf = (error: ProtocolError): ServerMessage => failure(error.id, error.command, error)
