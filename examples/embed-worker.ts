/** The worker entry of the embed example: real worker processes that load the app's engines. */
import { main } from "agentd/worker"
import { Engines } from "./embed-engine.js"

main(Engines)
