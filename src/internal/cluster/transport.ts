/**
 * The runners' connections to one another (@effect/cluster's socket transport: TCP, one RPC
 * protocol per peer), with one change: once the cluster drops a runner from its ring and that
 * runner does not answer a ping either, this runner's connections to it are closed at once.
 *
 * Why: a command sent to a runner just before a partition cut it off waits on a connection
 * nobody will answer. @effect/cluster only forgets that connection for new sends; the one in
 * flight ends when the RPC protocol's own ping finds the peer silent, which it checks every
 * 10 s: 10 to 20 s after the cut. The cluster then sends the command again, to the session's new
 * owner. Measured with the partition test (6 s lease): the sessions were adopted by the others
 * 6.3 s after the cut, a `get_state` sent through another runner before the cut was answered
 * only after 17 s. Closed at the ring's change, it is sent again then (what the cluster does
 * anyway, 10 s later). A runner dropped from the ring that still answers keeps its connections:
 * a command it is running is answered by it, not sent a second time elsewhere.
 *
 * Owns: the set of open connections per peer address.
 */
import * as Runners from "@effect/cluster/Runners"
import type * as RunnerAddress from "@effect/cluster/RunnerAddress"
import * as NodeSocket from "@effect/platform-node/NodeSocket"
import * as Socket from "@effect/platform/Socket"
import * as RpcClient from "@effect/rpc/RpcClient"
import * as RpcSerialization from "@effect/rpc/RpcSerialization"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import type * as Scope from "effect/Scope"
import * as net from "node:net"

/** How long a connection to a peer may take to open (@effect/cluster's own socket client: 1 s). */
const OPEN_TIMEOUT = "1 second"
/** How long a runner dropped from the ring has to answer a ping before its connections are closed. */
const PING_TIMEOUT = "2 seconds"

const keyOf = (address: RunnerAddress.RunnerAddress) => `${address.host}:${address.port}`

/** The open connections, per peer. */
export class Connections {
  private readonly open = new Map<string, Set<net.Socket>>()

  /**
   * A connection to `address`, tracked until it closes, destroyed with the scope. Its open waits
   * interruptibly, so that the open's timeout (fromDuplex's `openTimeout`) ends it: made in the
   * acquisition of an `acquireRelease` (uninterruptible), an open that got no answer was never
   * cut. Seen after a partition (test/e2e/clusterPartition.test.ts): a connect started while the
   * link was down stayed in SYN-SENT for about a minute after it came back (the kernel's SYN
   * retries, here from the address of another route: no answer could come), and every message
   * and health ping to that runner waited behind it, until the runner holding the health check
   * marked the runner that had rejoined unhealthy and its shards moved away.
   */
  connect(address: RunnerAddress.RunnerAddress): Effect.Effect<net.Socket, Socket.SocketError, Scope.Scope> {
    const key = keyOf(address)
    return Effect.gen(this, function*() {
      const conn = yield* Effect.acquireRelease(
        Effect.sync(() => net.createConnection({ host: address.host, port: address.port })),
        (conn) =>
          Effect.sync(() => {
            const set = this.open.get(key)
            set?.delete(conn)
            if (set?.size === 0) this.open.delete(key)
            conn.destroy()
          })
      )
      yield* Effect.async<void, Socket.SocketError>((resume) => {
        let settled = false
        conn.once("connect", () => {
          settled = true
          resume(Effect.void)
        })
        // Stays attached until the socket's reader adds its own: an error meanwhile is not thrown.
        conn.once("error", (cause) => {
          if (settled) return
          settled = true
          resume(Effect.fail(new Socket.SocketGenericError({ reason: "Open", cause })))
        })
      })
      const set = this.open.get(key) ?? new Set()
      set.add(conn)
      this.open.set(key, set)
      return conn
    })
  }

  /** Closes every connection to `address`: what waits on them fails (and the cluster sends it again). */
  close(address: RunnerAddress.RunnerAddress): number {
    const set = this.open.get(keyOf(address))
    if (set === undefined) return 0
    for (const conn of set) conn.destroy(new Error(`runner ${keyOf(address)} left the cluster and does not answer`))
    return set.size
  }
}

/** A socket to `address` over `connections`, its open bounded by {@link OPEN_TIMEOUT}. */
export const openSocket = (connections: Connections, address: RunnerAddress.RunnerAddress): Effect.Effect<Socket.Socket> =>
  NodeSocket.fromDuplex(connections.connect(address), { openTimeout: OPEN_TIMEOUT })

/**
 * The client protocol to other runners and a `Runners` over it (for `Sharding`) whose
 * `onRunnerUnavailable` also closes the connections to a runner that does not answer a ping.
 */
export const make = (self: RunnerAddress.RunnerAddress): {
  readonly clientProtocol: Layer.Layer<Runners.RpcClientProtocol, never, RpcSerialization.RpcSerialization>
  readonly closingUnavailable: <E, R>(runners: Layer.Layer<Runners.Runners, E, R>) => Layer.Layer<Runners.Runners, E, R>
} => {
  const connections = new Connections()
  const clientProtocol = Layer.effect(
    Runners.RpcClientProtocol,
    Effect.map(RpcSerialization.RpcSerialization, (serialization) => (address: RunnerAddress.RunnerAddress) =>
      Effect.flatMap(
        openSocket(connections, address),
        (socket) =>
          RpcClient.makeProtocolSocket().pipe(
            Effect.provideService(Socket.Socket, socket),
            Effect.provideService(RpcSerialization.RpcSerialization, serialization)
          )
      ))
  )
  const closingUnavailable = <E, R>(runners: Layer.Layer<Runners.Runners, E, R>) =>
    Layer.scoped(
      Runners.Runners,
      Effect.gen(function*() {
        const inner = yield* Runners.Runners
        const scope = yield* Effect.scope
        return Runners.Runners.of({
          ...inner,
          onRunnerUnavailable: (address) =>
            // This runner itself, leaving at its graceful stop (leave.ts): nothing to close.
            keyOf(address) === keyOf(self) ? inner.onRunnerUnavailable(address) : Effect.zipRight(
              inner.onRunnerUnavailable(address),
              // Beside the cluster's sync loop, which calls this: the ping may take its timeout.
              inner.ping(address).pipe(
                Effect.timeout(PING_TIMEOUT),
                Effect.catchAllCause(() =>
                  Effect.suspend(() => {
                    const closed = connections.close(address)
                    return closed === 0
                      ? Effect.void
                      : Effect.logWarning(`cluster: runner ${keyOf(address)} left the cluster and does not answer: ${closed} connection(s) to it closed`)
                  })
                ),
                Effect.forkIn(scope),
                Effect.asVoid
              )
            )
        })
      })
    ).pipe(Layer.provide(runners))
  return { clientProtocol, closingUnavailable }
}
