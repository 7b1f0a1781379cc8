/**
 * The Promise facade: create a session, prompt it, print the reply as it streams.
 *
 *   agentd serve &                 # or AGENTD_SOCKET=/path/to/agentd.sock
 *   node dist/examples/stream.js "hello there"
 */
import { connect, TurnInterrupted } from "agentd/client"

const client = await connect() // $AGENTD_SOCKET, else the default state dir's socket
try {
  const session = await client.create({ name: "stream example", config: { tokenDelayMs: 10 } })
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
