/**
 * The Promise facade: open the session named "stream example" (created at the first run, the
 * same one at every later run), prompt it, print the reply as it streams.
 *
 *   agentd serve &                 # or AGENTD_SOCKET=/path/to/agentd.sock
 *   node dist/examples/stream.js "hello there"
 */
import { connect, DaemonError, TurnInterrupted } from "agentd/client"

const NAME = "stream example"
const isError = (e: unknown, code: string) => e instanceof DaemonError && e.code === code

const client = await connect() // $AGENTD_SOCKET, else the default state dir's socket
try {
  // A session is named by its id, a unique prefix of it or its name, as on the command line.
  const named = client.session(NAME)
  const session = await named.getState().then(
    () => named,
    (e: unknown) => {
      if (!isError(e, "session_not_found")) throw e
      // The daemon keeps names unique: if another run created it meanwhile, that one is ours.
      return client.create({ name: NAME, config: { tokenDelayMs: 10 } }).catch((e2: unknown) => {
        if (isError(e2, "name_taken")) return client.session(NAME)
        throw e2
      })
    }
  )
  console.log(`session ${session.activeSessionId}`)
  for await (const event of session.prompt(process.argv[2] ?? "hello from agentd")) {
    if (event.type === "message_update") process.stdout.write(event.delta)
    if (event.type === "agent_end") process.stdout.write("\n")
  }
  const { total } = await session.getMessages()
  console.log(`${total} messages`)
} catch (e) {
  if (e instanceof TurnInterrupted) console.error(`turn interrupted: ${e.reason}`)
  throw e
} finally {
  await client.close()
}
