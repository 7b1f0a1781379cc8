export default async function framing(): Promise<void> {
  console.log("framing: pending")
}
